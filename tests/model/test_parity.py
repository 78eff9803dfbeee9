"""Parity with Hugging Face transformers on tiny random checkpoints (fp32).

Tolerance: |ours - transformers| <= 2e-4 absolute + 1e-4 relative on logits; greedy tokens equal.
"""
from __future__ import annotations

import pytest
import torch

from llmserve import LLM, SamplingParams

from .family_parity import StepRecorder
from .tiny_checkpoints import make_tiny_checkpoint

transformers = pytest.importorskip("transformers")

ATOL, RTOL = 2e-4, 1e-4

CASES = [
    pytest.param(("llama", 4, 4), id="llama-mha"),
    pytest.param(("llama", 4, 2), id="llama-gqa"),
    pytest.param(("llama", 4, 1), id="llama-mqa"),
    pytest.param(("qwen2", 4, 2), id="qwen2"),
    pytest.param(("qwen3", 4, 2), id="qwen3"),
    pytest.param(("llama", 4, 2, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 64}), id="llama3-rope"),
]

PROMPTS = [
    [5, 17, 300, 42, 9, 1000, 77],
    list(range(100, 137)),          # crosses block boundaries (block 16)
    [11, 12],
]


@pytest.fixture(scope="module", params=CASES)
def tiny(request, tmp_path_factory):
    arch, heads, kv_heads, *rope = request.param
    path = make_tiny_checkpoint(str(tmp_path_factory.mktemp(f"{arch}{kv_heads}")), arch=arch,
                                num_heads=heads, num_kv_heads=kv_heads, seed=1,
                                rope_scaling=rope[0] if rope else None)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    hf.eval()
    return path, hf


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def make_llm(path: str, **kw) -> LLM:
    args = dict(num_kv_blocks=64, block_size=16, dtype="float32", check_invariants=True)
    args.update(kw)
    return LLM(path, **args)


def test_prefill_logits_match(tiny):
    path, hf = tiny
    llm = make_llm(path)
    rec = StepRecorder(llm, all_logits=True)
    for prompt in PROMPTS:
        rec.steps.clear()
        out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
        got = rec.steps[0].all_logits[out[0].request_id]
        torch.testing.assert_close(got, hf_logits(hf, prompt), atol=ATOL, rtol=RTOL)


def test_decode_logits_match_step_by_step(tiny):
    path, hf = tiny
    llm = make_llm(path, enable_prefix_caching=False)
    rec = StepRecorder(llm)
    prompt = PROMPTS[0]
    out = llm.generate([prompt], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    toks = out[0].outputs[0].token_ids
    ref = hf_logits(hf, prompt + toks)
    got = torch.stack(rec.sampled_logits(out[0].request_id))
    torch.testing.assert_close(got, ref[len(prompt) - 1: len(prompt) - 1 + len(toks)],
                               atol=ATOL, rtol=RTOL)


def test_batch_of_different_lengths_matches_each_alone(tiny):
    path, _ = tiny
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    llm = make_llm(path, enable_prefix_caching=False)
    rec = StepRecorder(llm)
    alone = {}
    for i, p in enumerate(PROMPTS):
        rec.steps.clear()
        out = llm.generate([p], params)[0]
        alone[i] = (out.outputs[0].token_ids, torch.stack(rec.sampled_logits(out.request_id)))
    rec.steps.clear()
    outs = llm.generate(PROMPTS, params)
    assert len({len(s.request_ids) for s in rec.steps}) >= 1
    assert max(len(s.request_ids) for s in rec.steps) == len(PROMPTS)  # really batched
    for i, out in enumerate(outs):
        assert out.outputs[0].token_ids == alone[i][0]
        torch.testing.assert_close(torch.stack(rec.sampled_logits(out.request_id)), alone[i][1],
                                   atol=ATOL, rtol=RTOL)


def test_greedy_generation_matches_transformers_generate(tiny):
    path, hf = tiny
    llm = make_llm(path)
    prompt = PROMPTS[1]
    out = llm.generate([prompt], SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32,
                          do_sample=False, eos_token_id=None, pad_token_id=0)
    assert out[0].outputs[0].token_ids == ref[0, len(prompt):].tolist()


def test_chunked_prefill_matches_one_shot(tiny):
    path, _ = tiny
    prompt = PROMPTS[1]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    one = make_llm(path, enable_prefix_caching=False)
    r1 = StepRecorder(one)
    a = one.generate([prompt], params)[0]
    chunked = make_llm(path, enable_prefix_caching=False, max_num_batched_tokens=8)
    r2 = StepRecorder(chunked)
    b = chunked.generate([prompt], params)[0]
    assert len(r2.steps) >= len(prompt) // 8  # really chunked
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    torch.testing.assert_close(torch.stack(r2.sampled_logits(b.request_id)),
                               torch.stack(r1.sampled_logits(a.request_id)), atol=ATOL, rtol=RTOL)
