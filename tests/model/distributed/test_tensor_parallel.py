"""Tensor parallelism on CPU (gloo) with real spawned worker processes.

TP=2 must give the same greedy tokens as TP=1 and logits within 1e-4 (float32: the two
all-reduces per layer only reorder sums; measured differences are ~1e-6). Each TP=2
engine spawns one worker (a few seconds), so the cases are few: MHA (Llama), GQA with
q/k/v biases (Qwen2), MQA with a replicated K/V head and q/k norms (Qwen3).
"""
from __future__ import annotations

import time

import httpx
import pytest
import torch

from llmserve.async_llm import AsyncLLM
from llmserve.config import EngineConfig
from llmserve.llm import LLM
from llmserve.model.executor.capture import LogitsCapture
from llmserve.sampling_params import SamplingParams
from tests.model.tiny_checkpoints import make_tiny_checkpoint
from tests.server.conftest import LiveServer

PROMPTS = [list(range(100, 190)), [5, 17, 300], list(range(400, 437))]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
LOGITS_ATOL = 1e-4


def _run(path, tp: int, **kwargs):
    llm = LLM(path, dtype="float32", num_kv_blocks=64, num_threads=1, tensor_parallel_size=tp,
              **kwargs)
    runner = llm.engine.runner
    try:
        runner.capture = LogitsCapture.SAMPLED
        steps = []
        inner = runner.execute
        runner.execute = lambda step: steps.append(inner(step)) or steps[-1]
        outs = llm.generate(PROMPTS, GREEDY)
    finally:
        llm.engine.executor.shutdown()
    logits: dict = {}
    for out in steps:
        for j, rid in enumerate(out.request_ids):
            logits.setdefault(rid, []).append(out.logits[j])
    return [o.outputs[0].token_ids for o in outs], {k: torch.stack(v) for k, v in logits.items()}


@pytest.mark.parametrize("arch,heads,kv_heads", [("llama", 4, 4), ("qwen2", 4, 2),
                                                 ("qwen3", 4, 1)], ids=["mha", "gqa", "mqa"])
def test_tp2_matches_tp1(tmp_path, arch, heads, kv_heads):
    path = make_tiny_checkpoint(str(tmp_path / arch), arch=arch, num_heads=heads,
                                num_kv_heads=kv_heads, seed=5, intermediate=96)
    ref_tokens, ref_logits = _run(path, 1)
    tokens, logits = _run(path, 2)
    assert tokens == ref_tokens
    assert logits.keys() == ref_logits.keys()
    for rid in ref_logits:
        torch.testing.assert_close(logits[rid], ref_logits[rid], atol=LOGITS_ATOL, rtol=0)


def test_tp2_with_ngram_speculation_matches_tp1(tmp_path):
    """Drafts are verified on rank 0 after every rank computed the rows' logits together;
    a logit_bias request in the same steps takes the sampler's path."""
    path = make_tiny_checkpoint(str(tmp_path / "spec"), num_heads=4, num_kv_heads=2, seed=5)
    prompts = [[7, 8, 9, 10] * 6, list(range(100, 130)), [5, 17, 300] * 5]
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2),
              SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                             logit_bias={300: 5.0})]
    ref = LLM(path, dtype="float32", num_kv_blocks=64, num_threads=1).generate(prompts, params)
    llm = LLM(path, dtype="float32", num_kv_blocks=64, num_threads=1, tensor_parallel_size=2,
              speculative_method="ngram", num_speculative_tokens=4, ngram_min=1, ngram_max=3,
              speculative_adaptive=False)   # always draft: the test is about verification
    try:
        got = llm.generate(prompts, params)
        stats = llm.engine.spec.stats
    finally:
        llm.engine.executor.shutdown()
    assert [g.outputs[0].token_ids for g in got] == [r.outputs[0].token_ids for r in ref]
    assert stats.accepted_tokens > 0, stats


def test_default_model_tp3_matches_tp1():
    """The default model has 9 query and 3 K/V heads: TP=2 cannot split it (refused like
    the shapes in the next test), TP=3 can. Weights dequantized (packed GGUF blocks cannot be sliced)."""
    ref_tokens, ref_logits = _run(None, 1, quantization="none")
    tokens, logits = _run(None, 3, quantization="none")
    assert tokens == ref_tokens
    for rid in ref_logits:   # larger logits than the tiny models: a looser absolute bound
        torch.testing.assert_close(logits[rid], ref_logits[rid], atol=5e-4, rtol=1e-5)


def test_unsplittable_shapes_are_refused(tmp_path):
    path = make_tiny_checkpoint(str(tmp_path / "odd"), num_heads=3, num_kv_heads=3, hidden=48)
    with pytest.raises(ValueError, match="must divide num_attention_heads"):
        LLM(path, dtype="float32", num_kv_blocks=16, tensor_parallel_size=2, num_threads=1)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_moe_is_refused_before_any_worker_starts(tmp_path, monkeypatch, arch):
    """A mixture-of-experts family has no tensor-parallel plan: the error names it, and
    no worker process was started (the check runs before the group is formed)."""
    import multiprocessing

    from llmserve.model.distributed import workers

    started = []
    monkeypatch.setattr(workers, "start_rank_zero",
                        lambda *a, **k: started.append(a) or pytest.fail("workers spawned"))
    path = make_tiny_checkpoint(str(tmp_path / arch), arch=arch, num_heads=4, num_kv_heads=2)
    with pytest.raises(ValueError, match=f"the {arch} family is a mixture-of-experts model"):
        LLM(path, dtype="float32", num_kv_blocks=16, tensor_parallel_size=2, num_threads=1)
    assert started == [] and multiprocessing.active_children() == []


def test_every_dense_family_has_a_plan_and_the_registry_knows_every_plan():
    from llmserve.model.distributed.plans import MIXTURE_OF_EXPERTS, PLANS
    from llmserve.model.models.registry import MODEL_FAMILIES

    assert set(PLANS) | set(MIXTURE_OF_EXPERTS) == set(MODEL_FAMILIES)
    assert not set(PLANS) & set(MIXTURE_OF_EXPERTS)


def test_dead_worker_fails_ready_and_the_inflight_request(tmp_path):
    path = make_tiny_checkpoint(str(tmp_path / "m"), seed=2)
    engine = AsyncLLM.from_config(EngineConfig.from_kwargs(model=path, dtype="float32", num_kv_blocks=64,
                                               num_threads=1, tensor_parallel_size=2))
    worker = engine.engine.executor.group.workers[0]
    live = LiveServer(engine).start()
    try:
        assert httpx.get(live.url("/ready"), timeout=5).status_code == 200
        body = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 400, "temperature": 0,
                "ignore_eos": True, "stream": True}
        t0 = time.monotonic()
        with httpx.stream("POST", live.url("/v1/completions"), json=body, timeout=30) as resp:
            lines = resp.iter_lines()
            assert next(lines).startswith("data: ")   # streaming has begun
            worker.kill()
            rest = list(lines)                          # ends, rather than hangs
        assert time.monotonic() - t0 < 20
        assert any('"error"' in line for line in rest), rest[-3:]
        assert httpx.get(live.url("/ready"), timeout=5).status_code == 503
    finally:
        live.stop()
        engine.shutdown()
    assert not worker.is_alive() and worker.exitcode is not None   # reaped: no zombie
