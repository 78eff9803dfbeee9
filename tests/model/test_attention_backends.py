"""Every attention backend against the reference (gather + SDPA): same logits, same tokens.

Mixed batches of long and short contexts, GQA and MQA, chunked prefill (a small token
budget splits long prompts), fp32. The paged backend's in-place decode formulation (used
inside the compiled step) is also checked directly, eagerly and compiled.
"""
from __future__ import annotations

import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.model.attention.backend import make_backend
from llmserve.model.attention.paged import paged_decode_inplace
from llmserve.model.attention.reference import decode_group_attention

from .tiny_checkpoints import make_tiny_checkpoint

# long and short contexts in one batch; 90 tokens cross several 16-token blocks
PROMPTS = [list(range(100, 190)), [5, 17, 300], list(range(400, 437)), [11, 12, 13, 14, 15]]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module", params=[(4, 2), (4, 1), (4, 4)], ids=["gqa", "mqa", "mha"])
def tiny_path(request, tmp_path_factory):
    heads, kv_heads = request.param
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp(f"attn{kv_heads}")), arch="llama",
                                num_heads=heads, num_kv_heads=kv_heads, seed=11)


def _run(path: str, backend: str, **kw):
    llm = LLM(path, dtype="float32", num_kv_blocks=128, attention_backend=backend,
              check_invariants=True, **kw)
    runner = llm.engine.runner
    runner.capture_logits = True
    steps = []
    inner = runner.execute
    runner.execute = lambda step: steps.append(inner(step)) or steps[-1]
    outs = llm.generate(PROMPTS, GREEDY)
    logits = {}
    for out in steps:
        for j, rid in enumerate(out.request_ids):
            logits.setdefault(rid, []).append(out.logits[j])
    return [o.outputs[0].token_ids for o in outs], {k: torch.stack(v) for k, v in logits.items()}


@pytest.mark.parametrize("budget", [2048, 24], ids=["whole-prompts", "chunked-prefill"])
def test_paged_backend_matches_reference(tiny_path, budget):
    kw = dict(max_num_batched_tokens=budget)
    ref_tokens, ref_logits = _run(tiny_path, "reference", **kw)
    tokens, logits = _run(tiny_path, "paged", **kw)
    assert tokens == ref_tokens
    assert ref_logits.keys() == logits.keys()
    for rid in ref_logits:
        torch.testing.assert_close(logits[rid], ref_logits[rid], atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 1), (4, 4)])
def test_inplace_decode_equals_gather_sdpa(heads, kv_heads):
    torch.manual_seed(0)
    bs, d = 16, 64
    k_cache = torch.randn(20 * bs, kv_heads, d)
    v_cache = torch.randn(20 * bs, kv_heads, d)
    tables = torch.tensor([[1, 5, 7], [2, 3, 19], [4, 0, 0]])   # past ctx: padding
    ctx = torch.tensor([40, 33, 5])
    q = torch.randn(3, heads, d)
    backend = make_backend("paged", heads, kv_heads, d, bs)
    meta = backend.decode_metadata(torch.zeros(3, dtype=torch.long), tables, ctx)
    ref = decode_group_attention(q, k_cache, v_cache, tables, meta.decode_valid, bs, 0.125)
    got = paged_decode_inplace(q, k_cache, v_cache, meta.decode_slots, meta.decode_valid, 0.125)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    compiled = torch.compile(paged_decode_inplace, dynamic=True)
    torch.testing.assert_close(compiled(q, k_cache, v_cache, meta.decode_slots, meta.decode_valid,
                                        0.125), ref, atol=1e-5, rtol=1e-5)


def test_unknown_backend_is_a_clear_error(tiny_path):
    with pytest.raises(ValueError, match="attention_backend"):
        LLM(tiny_path, attention_backend="flash")
