"""llmserve's native CPU kernels (model/native/csrc): built here, checked against their references.

``int4_mm`` against the dequantized float product and PyTorch's int4 kernel, for every row
count a step produces (row tiles of 8, remainders, prefill-sized chunks) and every int4 group
size; ``paged_decode`` against the in-place reference formulation for GQA/MQA/MHA, head sizes
with and without a specialised kernel, soft-capping, masked holes; both inside a compiled
graph; an engine with them against one without; and the fallbacks (no compiler, disabled).
On a CPU without AVX512-BF16 the kernel tests skip and the fallback tests still run.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.model.attention.native_decode import paged_decode_native
from llmserve.model.attention.paged import paged_decode_inplace
from llmserve.model.executor.capture import LogitsCapture
from llmserve.model.native import ops as native
from llmserve.model.quant.kernels import Int4Weight, quantize_int4
from llmserve.model.quant.native_int4 import int4_mm, native_int4_a8_available, pack_int4
from tests.model.native import needs_native
from tests.model.tiny_checkpoints import make_tiny_checkpoint


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref).abs().max() / ref.abs().max()).item()


#: int4 weights (N, K, group): padded N, every group size, the model's K's
INT4_SHAPES = [(24, 64, 32), (192, 576, 32), (1040, 256, 64), (48, 512, 128), (32, 512, 256)]


@needs_native
@pytest.mark.parametrize("n,k,g", INT4_SHAPES)
def test_int4_mm_equals_the_dequantized_product(n, k, g):
    torch.manual_seed(n + k)
    groups = quantize_int4(torch.randn(n, k), g)
    fast, aten = Int4Weight(groups), Int4Weight(groups, native=False)
    assert fast.native and not aten.native
    assert fast.nbytes == aten.nbytes                     # same bytes as PyTorch's layout
    w = groups.dequantize()
    for rows in (1, 2, 3, 4, 5, 8, 9, 17, 33, 63, 64, 77, 130):
        x = torch.randn(rows, k).bfloat16()
        ref = x.float() @ w.T
        y = fast(x)
        assert y.shape == (rows, n) and y.dtype == torch.bfloat16
        # bf16 output rounding only: the panels from 64 rows keep the exact codes too
        assert rel_err(y, ref) <= 0.005, rows
        assert rel_err(y, aten(x).float()) <= 0.01, rows


def assert_rejects_a_weight_for_k64(product, weight) -> None:
    """An int4 product given x with K=128 and a weight packed for K=64 names the mismatch."""
    with pytest.raises(RuntimeError, match="packed weight is for K=64"):
        product(torch.randn(2, 128).bfloat16(), *weight, 32)


def assert_one_compiled_graph_for_every_batch(layer, k: int) -> None:
    """A compiled graph around ``layer`` (dynamic batch) is one graph for 2, 5 and 33 rows
    and equals the eager layer bit for bit."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    step = torch.compile(lambda t: torch.relu(layer(t)), fullgraph=True, dynamic=True)
    for rows in (2, 5, 33):
        x = torch.randn(rows, k).bfloat16()
        torch.testing.assert_close(step(x), torch.relu(layer(x)), atol=0, rtol=0)
    assert counters["stats"]["unique_graphs"] == 1


@needs_native
def test_int4_mm_rejects_a_mismatched_weight():
    groups = quantize_int4(torch.randn(32, 64), 32)
    assert_rejects_a_weight_for_k64(int4_mm, pack_int4(groups.q, groups.scale, groups.zero, 32))
    with pytest.raises(ValueError, match="N % 16"):
        pack_int4(groups.q[:24], groups.scale[:24], groups.zero[:24], 32)


@needs_native
def test_int4_mm_in_one_compiled_graph_for_every_batch():
    assert_one_compiled_graph_for_every_batch(Int4Weight(quantize_int4(torch.randn(96, 128), 32)),
                                              128)


def _decode_case(b, h, hkv, d, length, seed=0):
    gen = torch.Generator().manual_seed(seed)
    slots_n = 40 * 16
    kc = torch.randn(slots_n, hkv, d, generator=gen).bfloat16()
    vc = torch.randn(slots_n, hkv, d, generator=gen).bfloat16()
    q = torch.randn(b, h, d, generator=gen).bfloat16()
    blocks = torch.randperm(40, generator=gen)[:b * (-(-length // 16))].view(b, -1)
    slots = (blocks.unsqueeze(-1) * 16 + torch.arange(16)).view(b, -1)[:, :length]
    ctx = torch.randint(1, length + 1, (b,), generator=gen)
    ctx[0] = length
    valid = torch.arange(length).unsqueeze(0) < ctx.unsqueeze(1)
    return q, kc, vc, slots, valid


@needs_native
@pytest.mark.parametrize("h,hkv,d", [(9, 3, 64), (4, 1, 64), (4, 4, 64), (6, 2, 128),
                                     (8, 1, 128), (8, 4, 32), (4, 2, 256), (14, 2, 64),
                                     (16, 2, 64), (32, 8, 128), (28, 4, 128), (10, 2, 128),
                                     (12, 1, 64)])
@pytest.mark.parametrize("softcap", [None, 20.0])
def test_paged_decode_equals_the_inplace_reference(h, hkv, d, softcap):
    q, kc, vc, slots, valid = _decode_case(5, h, hkv, d, 37)
    valid[1, 3:9] = False                                 # a hole (a sliding window's edge)
    ref = paged_decode_inplace(q, kc, vc, slots, valid, d ** -0.5, softcap)
    got = paged_decode_native(q, kc, vc, slots, valid, d ** -0.5, softcap)
    assert got.shape == ref.shape == (5, h * d)
    torch.testing.assert_close(got.float(), ref.float(), atol=1e-2, rtol=1e-2)


@needs_native
@pytest.mark.parametrize("length", [1, 15, 16, 17, 48, 70])
@pytest.mark.parametrize("h,hkv,d,softcap", [(9, 3, 64, None), (6, 1, 64, None),
                                             (6, 2, 128, 30.0), (14, 2, 64, None),
                                             (16, 2, 128, 30.0)])
def test_paged_decode_scores_by_blocks_of_16_keys(length, h, hkv, d, softcap):
    # the fixed kernels score 16 keys at a time: partial blocks, a fully masked block
    # (a sliding window past the first 16 keys) and masked keys inside a block
    q, kc, vc, slots, valid = _decode_case(4, h, hkv, d, length, seed=length)
    valid[:] = True
    if length > 20:
        valid[2, :16] = False
        valid[3, 5:19] = False
    valid[1, length - 1] = False if length > 1 else True
    ref = paged_decode_inplace(q, kc, vc, slots, valid, d ** -0.5, softcap)
    got = paged_decode_native(q, kc, vc, slots, valid, d ** -0.5, softcap)
    torch.testing.assert_close(got.float(), ref.float(), atol=1e-2, rtol=1e-2)


@needs_native
@pytest.mark.parametrize("h,hkv,d", [(9, 3, 64), (14, 2, 64), (32, 8, 128), (12, 1, 64)])
def test_paged_decode_gives_a_row_the_same_bits_alone_and_in_a_batch(h, hkv, d):
    # the fixed kernels (groups up to 8: one task a row) and the run-time one (12 heads
    # over 1: a task per row and KV head), whatever the batch: bit for bit
    q, kc, vc, slots, valid = _decode_case(6, h, hkv, d, 45, seed=h)
    together = paged_decode_native(q, kc, vc, slots, valid, d ** -0.5)
    for r in range(6):
        alone = paged_decode_native(q[r:r + 1], kc, vc, slots[r:r + 1], valid[r:r + 1],
                                    d ** -0.5)
        assert torch.equal(together[r:r + 1].view(torch.int16), alone.view(torch.int16))


def _rows_case(h, hkv, d):
    """Rows of 0-300 keys (past two 128-key pull chunks): one with no valid key, a hole
    inside a block, short rows padded to the longest, a prompt-like run of rows of one
    sequence, and sequences that share their first block (a cached prefix) but not their
    tails, so the pull-skip rule meets both cases."""
    gen = torch.Generator().manual_seed(3400 + h)
    length, nblocks = 300, 64
    kc = torch.randn(nblocks * 16, hkv, d, generator=gen).bfloat16()
    vc = torch.randn(nblocks * 16, hkv, d, generator=gen).bfloat16()
    tables = torch.randperm(nblocks - 1, generator=gen)[:3 * 19].view(3, 19) + 1
    tables[:, 0] = 0
    seq_slots = (tables.unsqueeze(-1) * 16 + torch.arange(16)).view(3, -1)[:, :length]
    rows = [(0, 300), (1, 300), (2, 0), (1, 17), (2, 129), (0, 1), (1, 160), (2, 160)]
    slots = torch.stack([seq_slots[s] for s, _ in rows]).contiguous()
    valid = torch.stack([torch.arange(length) < n for _, n in rows])
    valid[1, 40:45] = False
    q = torch.randn(len(rows), h, d, generator=gen).bfloat16()
    return q, kc, vc, slots, valid.contiguous()


#: sha256 (16 hex digits) of paged_decode's output bits on _rows_case, recorded from the
#: kernel before it pulled its context and split rows by keys (316d0d2): a change of the
#: arithmetic's order shows here, not just beyond a tolerance.
_ROWS_CASE_DIGESTS = {
    (9, 3, 64, 0.0): "c46ddd1d803cfcfd", (9, 3, 64, 30.0): "c2c03d3ced8f847e",
    (4, 1, 64, 0.0): "59ee623077bed17c", (4, 1, 64, 30.0): "4c102d548e62b12a",
    (14, 2, 64, 0.0): "95c8df352584df6c", (14, 2, 64, 30.0): "e8f584140717b729",
    (16, 2, 128, 0.0): "e82a381e87f488f0", (16, 2, 128, 30.0): "55fc25a0b35db175",
}


@needs_native
@pytest.mark.parametrize("h,hkv,d,softcap", list(_ROWS_CASE_DIGESTS))
def test_paged_decode_row_bits_do_not_follow_the_thread_split_or_the_pulls(h, hkv, d,
                                                                           softcap):
    # each row alone (a task per KV head) and among the others (a task a row, split over
    # 1, 2 and all threads by keys, some rows skipping their pulls): the same bits, and the
    # bits the kernel gave before these changes
    q, kc, vc, slots, valid = _rows_case(h, hkv, d)
    scale = d ** -0.5
    alone = [paged_decode_native(q[r:r + 1], kc, vc, slots[r:r + 1], valid[r:r + 1], scale,
                                 softcap or None) for r in range(len(q))]
    threads = torch.get_num_threads()
    try:
        for n in sorted({1, 2, threads}):
            torch.set_num_threads(n)
            together = paged_decode_native(q, kc, vc, slots, valid, scale, softcap or None)
            for r in range(len(q)):
                assert torch.equal(together[r:r + 1].view(torch.int16),
                                   alone[r].view(torch.int16)), (n, r)
    finally:
        torch.set_num_threads(threads)
    digest = hashlib.sha256(together.view(torch.int16).numpy().tobytes()).hexdigest()[:16]
    assert digest == _ROWS_CASE_DIGESTS[(h, hkv, d, softcap)]
    assert (together[2] == 0).all()        # no valid key: zeros (the reference gives NaN)
    keep = [r for r in range(len(q)) if r != 2]
    ref = paged_decode_inplace(q[keep], kc, vc, slots[keep], valid[keep], scale, softcap or None)
    torch.testing.assert_close(together[keep].float(), ref.float(), atol=1e-2, rtol=1e-2)


@needs_native
def test_paged_decode_ignores_a_nan_key_that_is_masked():
    # a masked key whose cache row holds NaN (never written) leaves the output finite
    q, kc, vc, slots, valid = _decode_case(2, 9, 3, 64, 40)
    valid[:] = True
    valid[0, 20] = False
    kc[slots[0, 20]] = float("nan")
    vc[slots[0, 20]] = float("nan")
    out = paged_decode_native(q, kc, vc, slots, valid, 0.125)
    assert torch.isfinite(out[0].float()).all()
    ref = paged_decode_inplace(q[1:], kc, vc, slots[1:], valid[1:], 0.125)
    torch.testing.assert_close(out[1:].float(), ref.float(), atol=1e-2, rtol=1e-2)
    # a valid key whose K row is NaN (its score is NaN) drops out of the softmax instead
    # of becoming the peak: the output is that of the other keys, wherever it sits
    for pos in (3, 33):
        q, kc, vc, slots, valid = _decode_case(1, 9, 3, 64, 40, seed=pos)
        valid[:] = True
        kc[slots[0, pos]] = float("nan")
        out = paged_decode_native(q, kc, vc, slots, valid, 0.125)
        without = valid.clone()
        without[0, pos] = False
        ref = paged_decode_inplace(q, kc, vc, slots, without, 0.125)
        torch.testing.assert_close(out.float(), ref.float(), atol=1e-2, rtol=1e-2)


@needs_native
def test_paged_decode_with_no_valid_key_returns_zeros():
    q, kc, vc, slots, valid = _decode_case(2, 4, 2, 64, 20)
    valid[1] = False
    out = paged_decode_native(q, kc, vc, slots, valid, 0.125)
    assert torch.isfinite(out.float()).all()
    assert (out[1] == 0).all() and (out[0] != 0).any()


@needs_native
def test_paged_decode_inside_a_compiled_graph():
    q, kc, vc, slots, valid = _decode_case(3, 9, 3, 64, 50)
    step = torch.compile(lambda *a: paged_decode_native(*a, 0.125) * 2, fullgraph=True)
    torch.testing.assert_close(step(q, kc, vc, slots, valid),
                               paged_decode_native(q, kc, vc, slots, valid, 0.125) * 2)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("native")), arch="llama",
                                num_heads=4, num_kv_heads=2, seed=5)


def _logits(path: str, **kw):
    llm = LLM(path, dtype="bfloat16", num_kv_blocks=64, attention_backend="paged",
              check_invariants=True, enable_prefix_caching=True, **kw)
    runner = llm.engine.runner
    runner.capture = LogitsCapture.SAMPLED
    steps = []
    inner = runner.execute
    runner.execute = lambda step: steps.append(inner(step)) or steps[-1]
    prompts = [list(range(100, 160)), [5, 17, 300], list(range(400, 421))]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, params)
    # shared prefixes: these prefill from a cached block on (chunks that start mid-context)
    outs += llm.generate([list(range(100, 140)) + [7, 8, 9], list(range(400, 421)) + [3]],
                         params)
    return llm, [o.outputs[0].token_ids for o in outs], steps


@needs_native
@pytest.mark.parametrize("budget", [2048, 24], ids=["whole-prompts", "chunked-prefill"])
def test_engine_attends_with_the_native_kernel_as_without(tiny_path, monkeypatch, budget):
    """Decodes and prefill chunks (whole, chunked, after a prefix-cache hit) through the
    native kernel give the logits of the engine without it."""
    llm, tokens, steps = _logits(tiny_path, max_num_batched_tokens=budget)
    assert llm.engine.runner.backend.native_decode
    monkeypatch.setattr("llmserve.model.attention.paged.native_decode_serves",
                        lambda dtype, kv_dtype=None: False)
    off, ref_tokens, ref_steps = _logits(tiny_path, max_num_batched_tokens=budget)
    assert not off.engine.runner.backend.native_decode
    assert len(steps) == len(ref_steps)
    for out, ref in zip(steps, ref_steps):
        assert (out.logits is None) == (ref.logits is None)   # chunks that sample nothing
        if out.logits is not None:
            torch.testing.assert_close(out.logits.float(), ref.logits.float(), atol=0.05,
                                       rtol=0.02)
    agree = sum(a == b for t, r in zip(tokens, ref_tokens) for a, b in zip(t, r))
    assert agree >= 0.9 * sum(len(t) for t in tokens)


def test_no_compiler_falls_back_with_a_warning(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(native, "_state", {"fakes": True})
    monkeypatch.setenv("LLMSERVE_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(native, "cpu_flags", lambda: set(native.REQUIRED_CPU_FLAGS))
    monkeypatch.delenv("LLMSERVE_CPU_ISA", raising=False)   # a forced lower tier builds nothing
    monkeypatch.setenv("CXX", "/bin/false")
    monkeypatch.setattr(native.shutil, "which",
                        lambda name: "/bin/false" if name == "/bin/false" else None)
    with caplog.at_level(logging.WARNING, logger="llmserve.model.native.ops"):
        assert native.native_available() is False
    assert "unavailable" in caplog.text and "exited 1" in caplog.text


def test_disabled_or_missing_cpu_features_use_pytorch_kernels(monkeypatch):
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setenv("LLMSERVE_NATIVE_KERNELS", "0")
    assert native.native_available() is False
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.delenv("LLMSERVE_NATIVE_KERNELS")
    monkeypatch.setattr(native, "cpu_flags", lambda: {"avx2", "fma"})
    assert native.native_available() is False
    monkeypatch.setattr("llmserve.model.quant.kernels.native_int4_available", lambda: False)
    groups = quantize_int4(torch.randn(16, 32), 32)
    assert not Int4Weight(groups).native
    with pytest.raises(ValueError, match="not available"):
        Int4Weight(groups, native=True)


@needs_native
@pytest.mark.parametrize("n,k", [(48, 64), (1000, 96), (17000, 64)])
def test_int8_mm_equals_the_dequantized_product(n, k):
    from llmserve.model.quant.kernels import Int8Weight, quantize_int8
    torch.manual_seed(n)
    q, scale = quantize_int8(torch.randn(n, k))
    fast, aten = Int8Weight(q, scale), Int8Weight(q, scale, native=False)
    assert fast.native and fast.nbytes >= aten.nbytes and fast.nbytes - aten.nbytes < 16 * (k + 2)
    w = q.float() * scale.float().unsqueeze(1)
    for rows in (1, 2, 3, 5, 8, 9, 33):
        x = torch.randn(rows, k).bfloat16()
        ref = x.float() @ w.T
        assert rel_err(fast(x), ref) <= 0.005, rows
        logits = fast.logits(x)
        assert logits.dtype == torch.float32 and logits.shape == (rows, n)
        assert rel_err(logits, ref) <= 1e-5, rows       # float32 sums, no bf16 rounding
    ids = torch.tensor([[0, n - 1], [17, 5]])
    torch.testing.assert_close(fast.rows(ids, torch.float32), aten.rows(ids, torch.float32))


@needs_native
@pytest.mark.parametrize("bias", [False, True])
def test_dense_bf16_linear_uses_the_native_kernel(bias):
    from llmserve.model.layers.linear import DenseLinearMethod, Linear
    torch.manual_seed(3)
    layer = Linear(96, 40, bias=bias, method=DenseLinearMethod(), dtype=torch.bfloat16,
                   device=torch.device("cpu"))
    w = torch.randn(40, 96).bfloat16()
    layer.load("weight", w)
    if bias:
        layer.load("bias", torch.randn(40).bfloat16())
    ref_bias = layer.bias
    layer.method.process_weights_after_loading(layer)
    assert layer.native_weight is not None and layer.weight is None     # kept once
    assert layer.weight_bytes == 48 * 96 * 2 + (80 if bias else 0)      # padded to 16 rows
    for rows in (1, 3, 8, 9, 13, 30):
        x = torch.randn(2, rows, 96).bfloat16()
        ref = x.float() @ w.float().T + (ref_bias.float() if bias else 0)
        y = layer(x)
        assert y.shape == (2, rows, 40) and y.dtype == torch.bfloat16
        assert rel_err(y, ref) <= 0.01, rows


@needs_native
def test_dense_bf16_lm_head_returns_float32_logits():
    """A tied bf16 head keeps the float32 sums: near-tied logits are not rounded to bf16's
    1/8 step at magnitude ~20 (where a greedy pick between them would become a coin flip)."""
    from llmserve.model.layers.native_dense import bf16_mm, pack_bf16
    torch.manual_seed(4)
    w = torch.randn(70, 64).bfloat16()
    x = (torch.randn(3, 64) * 4).bfloat16()
    ref = x.float() @ w.float().T
    logits = bf16_mm(x, pack_bf16(w), 70, float_out=True)
    assert logits.dtype == torch.float32 and logits.shape == (3, 70)
    assert rel_err(logits, ref) <= 1e-5
    assert rel_err(bf16_mm(x, pack_bf16(w), 70), ref) > 1e-4       # bf16 output rounds


SCRIPTS = Path(__file__).resolve().parents[3] / "scripts"


def _run_script(name: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(SCRIPTS.parent / "src")}
    return subprocess.run([sys.executable, str(SCRIPTS / name), *args], capture_output=True,
                          text=True, timeout=600, env=env)


@needs_native
def test_bench_native_kernels_script_prints_and_writes_figures(tmp_path):
    out = tmp_path / "kernels.json"
    proc = _run_script("bench_native_kernels.py", "--repeats", "2", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    a8 = {"int4_a8_mm", "int8_a8_mm"} if native_int4_a8_available() else set()
    assert {r["op"] for r in rows} == {"int4_mm", "int8_mm", "bf16_mm", "paged_decode", "f32_mm",
                                       "torch-linear"} | a8
    assert all(r["us"] > 0 for r in rows)
    assert "paged_decode  prefill rows" in proc.stdout


def test_step_timeline_script_runs_a_burst(tiny_path):
    proc = _run_script("step_timeline.py", "--num-prompts", "3", "--input-len", "20",
                       "--output-len", "5", "--repeats", "1", f"model={tiny_path}",
                       "enforce_eager=True", "max_num_batched_tokens=32", "num_kv_blocks=64")
    assert proc.returncode == 0, proc.stderr[-2000:]
    # 60 prompt tokens under a 32-token budget: two prompt steps, then the decodes
    line = next(x for x in proc.stdout.splitlines() if x.startswith("repeat 0:"))
    m = re.search(r"([\d.]+) output tok/s, (\d+) steps; prompt steps \(budget 32 tokens\) "
                  r"([\d.]+), ([\d.]+) s; decode steps [\d.]+ s, median [\d.]+ ms", line)
    assert m, line
    assert float(m.group(1)) > 0 and 5 <= int(m.group(2)) <= 8


def assert_rows_never_depend_on_their_batch(product, k: int) -> None:
    """Each row of ``product`` over 1..130 rows (every row tile, remainder and the many-row
    panels) has the bits it has alone: no row-count-dependent summation order."""
    torch.manual_seed(k)
    x = torch.randn(130, k).bfloat16()
    x[7] *= 300                                   # an outlier row
    alone = torch.cat([product(x[i:i + 1]) for i in range(x.shape[0])])
    for rows in (2, 3, 4, 5, 8, 9, 13, 17, 63, 64, 65, 77, 130):
        assert torch.equal(product(x[:rows]), alone[:rows]), rows
    assert torch.equal(product(x[50:121]), alone[50:121])


@needs_native
@pytest.mark.parametrize("g", [32, 128])
def test_int4_mm_rows_never_depend_on_their_batch(g):
    layer = Int4Weight(quantize_int4(torch.randn(80, 256), g))
    assert layer.native and not layer.int8_activations
    assert_rows_never_depend_on_their_batch(layer, 256)


@needs_native
@pytest.mark.parametrize("float_out", [False, True])
@pytest.mark.parametrize("k", [192, 70])   # 70: 35 pairs, a tail of 3 after the groups of 4
def test_bf16_mm_rows_never_depend_on_their_batch(float_out, k):
    from llmserve.model.layers.native_dense import bf16_mm, pack_bf16
    w = torch.randn(72, k).bfloat16()
    packed = pack_bf16(w)
    assert_rows_never_depend_on_their_batch(lambda t: bf16_mm(t, packed, 72, float_out), k)
    x = torch.randn(20, k).bfloat16()
    ref = x.float() @ w.float().T
    assert rel_err(bf16_mm(x, packed, 72, True), ref) <= 1e-5


@needs_native
@pytest.mark.parametrize("k", [320, 70])
def test_int8_mm_rows_never_depend_on_their_batch(k):
    from llmserve.model.quant.kernels import Int8Weight, quantize_int8
    layer = Int8Weight(*quantize_int8(torch.randn(48, k)))
    assert layer.native and not layer.int8_activations
    assert_rows_never_depend_on_their_batch(layer, k)
    assert_rows_never_depend_on_their_batch(layer.logits, k)
