"""The compiled decode step against the eager reference on a tiny model (fp32).

It must give the same greedy tokens and (within float tolerance) the same logits for
batches of every bucket size, as contexts grow across block boundaries (dynamic width),
mixed with eager prefill steps; and fall back to eager with a warning if compiling fails.
"""
from __future__ import annotations

import logging

import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.model.executor.capture import LogitsCapture
from llmserve.model.executor.compile import batch_buckets
from tests.model.tiny_checkpoints import make_tiny_checkpoint

GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("compiled")), arch="qwen3",
                                num_heads=4, num_kv_heads=2, seed=21)


def _generate(llm: LLM, prompts):
    runner = llm.engine.runner
    runner.capture = LogitsCapture.SAMPLED
    steps = []
    inner = runner.execute
    runner.execute = lambda step: steps.append((step.is_decode_only, inner(step))) or steps[-1][1]
    outs = llm.generate(prompts, GREEDY)
    runner.execute = inner
    logits = {}
    for _, out in steps:
        for j, rid in enumerate(out.request_ids):
            logits.setdefault(rid, []).append(out.logits[j])
    decode_steps = sum(1 for d, _ in steps if d)
    return ([o.outputs[0].token_ids for o in outs],
            [torch.stack(logits[o.request_id]) for o in outs], decode_steps)


@pytest.fixture(scope="module")
def compiled_llm(tiny_path):
    return LLM(tiny_path, dtype="float32", num_kv_blocks=128, max_num_seqs=8,
               enforce_eager=False, check_invariants=True)


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_compiled_decode_equals_eager(tiny_path, compiled_llm, batch):
    prompts = [list(range(100 + 13 * i, 100 + 13 * i + 5 + 9 * i)) for i in range(batch)]
    eager = LLM(tiny_path, dtype="float32", num_kv_blocks=128, max_num_seqs=8,
                enforce_eager=True)
    ref_tokens, ref_logits, _ = _generate(eager, prompts)
    tokens, logits, decode_steps = _generate(compiled_llm, prompts)
    assert compiled_llm.engine.runner.compiled is not None
    assert not compiled_llm.engine.runner.compiled.failed
    assert decode_steps >= GREEDY.max_tokens - 1
    assert tokens == ref_tokens
    for got, ref in zip(logits, ref_logits):
        torch.testing.assert_close(got, ref, atol=2e-4, rtol=1e-4)


def test_batches_between_buckets_run_unpadded_without_recompiling(compiled_llm):
    """The batch is dynamic: 3, 5, 6 and 7 sequences run as themselves (no padding rows)
    in the graph warmed up at 2, 4, 8, and never make a new one."""
    from torch._dynamo.utils import counters

    runner = compiled_llm.engine.runner
    assert [runner.compiled.accepts(n) for n in (1, 3, 5, 8, 9)] == [True] * 4 + [False]
    rows = []
    stage = runner.buffers.stage

    def recording(step, order, block_size, pad_to=None):
        staged = stage(step, order, block_size, pad_to=pad_to)
        rows.append((step.num_seqs, staged.input_ids.shape[0]))
        return staged

    runner.buffers.stage = recording
    try:
        graphs = counters["stats"]["unique_graphs"]
        for batch in (3, 5, 6, 7):
            _generate(compiled_llm, [[7 + i, 8, 9 + batch] for i in range(batch)])
        assert counters["stats"]["unique_graphs"] == graphs
    finally:
        del runner.buffers.stage
    decode_rows = {seqs: n for seqs, n in rows if seqs == n}
    assert {3, 5, 6, 7} <= set(decode_rows)
    assert all(n == seqs for seqs, n in rows if n <= 8)    # decode steps: never padded


def test_verify_steps_with_drafts_run_compiled_and_match_eager(tiny_path):
    """n-gram drafts are verified by the compiled verify graph (k + 1 rows per sequence,
    shorter ones padded; sequences without drafts in the same step): the same tokens and
    logits as eager verification."""
    # drafts planned from the tokens alone (the step-cost model plans from timings, which
    # differ between the eager and the compiled engine)
    kw = dict(dtype="float32", num_kv_blocks=128, max_num_seqs=8, speculative_method="ngram",
              num_speculative_tokens=5, ngram_min=1, ngram_max=2, speculative_adaptive=False)
    prompts = [[9, 10, 11, 12] * 6, list(range(200, 213)), [7, 8] * 9]
    ref_tokens, ref_logits, _ = _generate(LLM(tiny_path, enforce_eager=True, **kw), prompts)
    llm = LLM(tiny_path, enforce_eager=False, **kw)
    verify = llm.engine.runner.compiled_verify
    assert verify is not None and verify.max_rows == 6
    shapes = []
    inner = verify._compiled
    verify._compiled = lambda *a: shapes.append(tuple(a[0].shape)) or inner(*a)
    tokens, logits, _ = _generate(llm, prompts)
    assert not verify.failed
    assert shapes and len({seqs for seqs, _ in shapes}) >= 2   # batches of several sizes
    assert llm.engine.spec.stats.accepted_tokens > 0
    assert tokens == ref_tokens
    for got, ref in zip(logits, ref_logits):
        torch.testing.assert_close(got, ref, atol=2e-4, rtol=1e-4)
    assert llm.engine.kv.num_used_blocks == 0


def test_two_models_in_one_process_never_share_a_graph(tiny_path, compiled_llm):
    """Graphs skip the guards on a static model's modules, so each compiled step owns its
    code object: the same checkpoint with LoRA wrappers (same input shapes, other modules)
    compiles its own graph instead of running the first one's (which fails on them)."""
    prompts = [[5, 6, 7, 8]]
    compiled_llm.generate(prompts, GREEDY)   # the plain model's graph exists
    kw = dict(dtype="float32", num_kv_blocks=128, max_num_seqs=8)
    ref = LLM(tiny_path, enforce_eager=True, **kw).generate(prompts, GREEDY)
    llm = LLM(tiny_path, enforce_eager=False, max_loras=1, **kw)
    assert llm.engine.runner.lora is not None
    got = llm.generate(prompts, GREEDY)
    assert not llm.engine.runner.compiled.failed
    assert got[0].outputs[0].token_ids == ref[0].outputs[0].token_ids


def test_buckets_cover_max_num_seqs():
    assert batch_buckets(1) == [1]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(48) == [1, 2, 4, 8, 16, 32, 64]


def test_compile_failure_falls_back_to_eager(tiny_path, monkeypatch, caplog):
    llm = LLM(tiny_path, dtype="float32", num_kv_blocks=64, max_num_seqs=2, enforce_eager=True)
    runner = llm.engine.runner
    from llmserve.model.executor.compile import CompiledDecodeStep

    step = CompiledDecodeStep(runner.model, runner.backend, runner.kv_caches, runner.buffers, 2)

    def broken(*args, **kwargs):
        raise RuntimeError("inductor exploded")

    step._compiled = broken
    runner.compiled = step
    ref = LLM(tiny_path, dtype="float32", num_kv_blocks=64, max_num_seqs=2, enforce_eager=True)
    with caplog.at_level(logging.WARNING, logger="llmserve.model.executor.compile"):
        got = llm.generate([[5, 6, 7]], GREEDY)[0].outputs[0].token_ids
    assert step.failed
    assert "running eagerly" in caplog.text
    assert got == ref.generate([[5, 6, 7]], GREEDY)[0].outputs[0].token_ids


def test_long_prefill_uses_the_compiled_rows_functions_and_matches_eager(tiny_path,
                                                                         compiled_llm):
    """A compiling engine gives its rotary embedding and MLP activations compiled many-row
    functions (prefill chunks of 64+ rows: layers/compiled_rows.py); its RMSNorms call one
    opaque norm on every path (layers/norm.py), the same as the eager engine's. The logits
    stay those of the eager engine, whose modules stay plain."""
    from llmserve.model.layers.compiled_rows import COMPILED_ROWS_MIN
    from llmserve.model.layers.norm import RMSNorm

    def rows_modules(llm):
        return [m for m in llm.engine.runner.model.modules() if hasattr(m, "compile_rows")]

    compiled = rows_modules(compiled_llm)
    kinds = {type(m).__name__ for m in compiled}
    assert {"RotaryEmbedding", "GatedMLP"} <= kinds
    attr = {"RotaryEmbedding": "rows_rotary", "GatedMLP": "rows_act"}
    assert all(getattr(m, attr[type(m).__name__]) is not None for m in compiled)
    eager = LLM(tiny_path, dtype="float32", num_kv_blocks=128, max_num_seqs=8,
                enforce_eager=True)
    assert all(getattr(m, attr[type(m).__name__]) is None for m in rows_modules(eager))
    norms = [m for llm in (compiled_llm, eager) for m in llm.engine.runner.model.modules()
             if isinstance(m, RMSNorm)]
    assert len({m.rows_norm for m in norms}) == 1
    calls: "dict[str, list[int]]" = {}
    wrapped = {}
    for kind in attr:
        module = next(m for m in compiled if type(m).__name__ == kind)
        inner = getattr(module, attr[kind])
        wrapped[kind] = (module, inner)

        def spy(*a, _kind=kind, _inner=inner):
            rows = a[1].shape[0] if _kind == "RotaryEmbedding" else a[0].shape[0]
            calls.setdefault(_kind, []).append(rows)
            return _inner(*a)
        setattr(module, attr[kind], spy)
    try:
        prompts = [list(range(200, 200 + COMPILED_ROWS_MIN + 30))]
        ref_tokens, ref_logits, _ = _generate(eager, prompts)
        tokens, logits, _ = _generate(compiled_llm, prompts)
    finally:
        for kind, (module, inner) in wrapped.items():
            setattr(module, attr[kind], inner)
    assert set(calls) == set(attr)
    assert all(min(rows) >= COMPILED_ROWS_MIN for rows in calls.values())
    assert tokens == ref_tokens
    torch.testing.assert_close(logits[0], ref_logits[0], atol=2e-4, rtol=1e-3)


def test_compiled_rows_functions_hold_one_graph_for_any_row_count(compiled_llm):
    """After start-up the many-row functions never recompile: prefill chunks of other row
    counts (and q/k as strided views of the fused projection) reuse the warm-up graphs."""
    from torch._dynamo.utils import counters

    before = counters["stats"]["unique_graphs"]
    prompts = [list(range(300, 300 + n)) for n in (70, 131, 257)]
    for prompt in prompts:
        compiled_llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0))
    assert counters["stats"]["unique_graphs"] == before


def test_a_graph_traced_over_many_rows_does_not_guard_on_the_row_count():
    """Inside a dynamic-batch graph the modules inline their plain code without comparing
    the row count with the many-row threshold (a guard that would split the graph at 64)."""
    from torch._dynamo.utils import counters

    from llmserve.model.layers.activation import silu_and_mul
    from llmserve.model.layers.compiled_rows import COMPILED_ROWS_MIN
    from llmserve.model.layers.linear import DenseLinearMethod
    from llmserve.model.models.base import GatedMLP

    cpu = torch.device("cpu")
    mlp = GatedMLP(32, 16, "silu", DenseLinearMethod(prepack=False), torch.float32, cpu)
    for lin in (mlp.gate_up_proj, mlp.down_proj):
        lin.weight.data.copy_(torch.randn_like(lin.weight))
    assert mlp.compile_rows(torch.float32, cpu)
    torch._dynamo.reset()
    counters.clear()
    step = torch.compile(lambda t: torch.relu(mlp(t)), dynamic=True)
    for rows in (COMPILED_ROWS_MIN + 6, 3, 17):
        x = torch.randn(rows, 32)
        plain = mlp.down_proj(silu_and_mul(mlp.gate_up_proj(x)))
        torch.testing.assert_close(step(x), torch.relu(plain))
    assert counters["stats"]["unique_graphs"] == 1
