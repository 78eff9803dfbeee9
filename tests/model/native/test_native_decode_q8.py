"""Decode attention over an 8-bit KV cache (int8 or fp8 e4m3 codes, a float32 scale a row),
read in place: the AVX-512 library's ``paged_decode_q8`` (bf16 queries) and the avx2
library's ``paged_decode`` (bf16 or float32 queries, on every tier from avx2 up).

Each against the reference that dequantizes the cache first (``paged_decode_inplace``), for
the fixed kernels (head size 64 or 128, up to 8 query heads a KV head) and the run-time one,
with soft-capping, masked holes, rows past a 128-key pull chunk and a row with no valid key;
each row's bits the same alone, in a batch and over any thread split; every fp8 code read as
torch reads it; inside a compiled graph; and the operand errors.
"""
from __future__ import annotations

import pytest
import torch

from llmserve.model.attention.paged import paged_decode_inplace
from llmserve.model.native import ops
from llmserve.model.platform import cpu_flags
from llmserve.model.quant.kv import quantize_kv

needs_native = pytest.mark.skipif(not ops.native_available(),
                                  reason="needs AVX512-BF16 and a C++ compiler")
HAS_AVX2 = ops.CPU_TIERS["avx2"] <= cpu_flags() and ops._compiler() is not None


@pytest.fixture(scope="module")
def avx2():
    if not HAS_AVX2:
        pytest.skip("needs AVX2 + FMA + F16C and a C++ compiler")
    path = ops.build(ops._compiler(), "llmserve_avx2", ops.AVX2_SOURCES, ops.AVX2_HEADERS,
                     ops._AVX2_FLAGS)
    torch.ops.load_library(str(path))
    return torch.ops.llmserve_avx2


FP8 = torch.float8_e4m3fn
CODES = [torch.int8, FP8]


def _case(h: int, hkv: int, d: int, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
          code: torch.dtype = torch.int8):
    """Rows of 0-300 keys over int8 caches: a row with no valid key, a hole inside a block,
    rows past two 128-key pull chunks, a prompt-like run of rows of one sequence."""
    gen = torch.Generator().manual_seed(seed + 100 * h + d)
    n_slots, length = 64 * 16, 300
    kc = quantize_kv(torch.randn(n_slots, hkv, d, generator=gen) * 2, code)
    vc = quantize_kv(torch.randn(n_slots, hkv, d, generator=gen), code)
    seq = torch.randperm(n_slots, generator=gen)[:2 * length].view(2, length)
    lens = [300, 0, 17, 129, 160, 1, 161, 162]
    slots = torch.stack([seq[0 if i != 1 else 1] for i in range(len(lens))]).contiguous()
    valid = torch.stack([torch.arange(length) < n for n in lens])
    valid[4, 40:45] = False
    q = torch.randn(len(lens), h, d, generator=gen).to(dtype)
    return q, kc, vc, slots, valid.contiguous()


def _check(op, q, kc, vc, slots, valid, softcap: float, bits: torch.dtype) -> None:
    d = q.shape[2]
    scale = d ** -0.5
    got = op(q, kc, vc, slots, valid, scale, softcap)
    assert got.shape == (q.shape[0], q.shape[1] * d) and got.dtype == q.dtype
    assert (got[1] == 0).all()                     # no valid key: zeros (the reference: NaN)
    keep = [r for r in range(len(q)) if r != 1]
    ref = paged_decode_inplace(q[keep], kc, vc, slots[keep], valid[keep], scale,
                               softcap or None)
    torch.testing.assert_close(got[keep].float(), ref.float(), atol=1e-2, rtol=1e-2)
    threads = torch.get_num_threads()
    try:
        for n in sorted({1, 2, threads}):
            torch.set_num_threads(n)
            for r in range(len(q)):
                alone = op(q[r:r + 1], kc, vc, slots[r:r + 1], valid[r:r + 1], scale, softcap)
                assert torch.equal(alone.view(bits), got[r:r + 1].view(bits)), (n, r)
            again = op(q, kc, vc, slots, valid, scale, softcap)
            assert torch.equal(again.view(bits), got.view(bits)), n
    finally:
        torch.set_num_threads(threads)


@needs_native
@pytest.mark.parametrize("h,hkv,d", [(9, 3, 64), (14, 2, 64), (4, 4, 64), (16, 2, 128),
                                     (32, 8, 128), (12, 1, 64), (8, 4, 32)])
@pytest.mark.parametrize("softcap", [0.0, 30.0])
@pytest.mark.parametrize("code", CODES, ids=["int8", "fp8"])
def test_paged_decode_q8_follows_the_reference_and_keeps_each_rows_bits(h, hkv, d, softcap,
                                                                        code):
    # (12, 1, 64) and (8, 4, 32) take the run-time kernel, the others a fixed one
    q, kc, vc, slots, valid = _case(h, hkv, d, code=code)
    _check(torch.ops.llmserve_native.paged_decode_q8, q, kc, vc, slots, valid, softcap,
           torch.int16)


@pytest.mark.parametrize("h,hkv,d", [(9, 3, 64), (14, 2, 64), (8, 1, 16)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("code", CODES, ids=["int8", "fp8"])
def test_the_avx2_kernel_reads_8bit_caches_under_bf16_and_float32_queries(avx2, h, hkv, d,
                                                                          dtype, code):
    q, kc, vc, slots, valid = _case(h, hkv, d, dtype, code=code)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    for softcap in (0.0, 30.0):
        _check(avx2.paged_decode, q, kc, vc, slots, valid, softcap, bits)


def _all_fp8_values(dtype: torch.dtype):
    """V rows holding every fp8 code but the two NaNs (scale 1), and one query row per V
    row attending to it alone: the output is the row's values, rounded to ``dtype``. K rows
    decode through the same function (then widen to bf16, exactly), which the reference
    tests above check."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    codes = torch.cat([codes, codes[:2]]).view(-1, 1, 64)           # 256 codes, 4 rows
    one = torch.tensor([1.0]).view(torch.uint8).expand(4, 1, 4)
    vc = torch.cat([codes, one], -1).contiguous().view(FP8)          # (4, 1, 68)
    kc = vc.clone()
    q = torch.randn(4, 2, 64).to(dtype)
    slots = torch.arange(4).view(4, 1)
    valid = torch.ones(4, 1, dtype=torch.bool)
    want = codes.view(FP8).float().view(4, 64).repeat(1, 2).to(dtype)
    return q, kc, vc, slots, valid, want


@needs_native
def test_paged_decode_q8_reads_every_fp8_code_as_torch_does():
    q, kc, vc, slots, valid, want = _all_fp8_values(torch.bfloat16)
    got = torch.ops.llmserve_native.paged_decode_q8(q, kc, vc, slots, valid, 0.125, 0.0)
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_avx2_kernel_reads_every_fp8_code_as_torch_does(avx2, dtype):
    q, kc, vc, slots, valid, want = _all_fp8_values(dtype)
    assert torch.equal(avx2.paged_decode(q, kc, vc, slots, valid, 0.125, 0.0), want)


@needs_native
@pytest.mark.parametrize("h,hkv", [(9, 3), (12, 1)])
@pytest.mark.parametrize("code", CODES, ids=["int8", "fp8"])
def test_a_masked_row_holding_nan_leaves_the_output_finite(h, hkv, code):
    # a masked key's row (never written: here a NaN scale) is read neither for its score nor
    # for its value, in the fixed kernel and the run-time one
    q, kc, vc, slots, valid = _case(h, hkv, 64, code=code)
    hole = slots[4, 42]                           # masked in row 4 (its window's hole)
    nan = torch.tensor([0, 0, 192, 127], dtype=torch.uint8)
    kc.view(torch.uint8)[hole, :, 64:] = nan
    vc.view(torch.uint8)[hole, :, 64:] = nan
    out = torch.ops.llmserve_native.paged_decode_q8(q[4:5], kc, vc, slots[4:5], valid[4:5],
                                                    0.125, 0.0)
    assert torch.isfinite(out.float()).all()


@needs_native
def test_paged_decode_q8_inside_a_compiled_graph():
    from llmserve.model.attention.native_decode import native_decode_serves, paged_decode_native

    assert native_decode_serves(torch.bfloat16, torch.int8)
    q, kc, vc, slots, valid = _case(9, 3, 64)
    step = torch.compile(lambda *a: paged_decode_native(*a, 0.125) * 2, fullgraph=True)
    assert torch.equal(step(q, kc, vc, slots, valid),
                       paged_decode_native(q, kc, vc, slots, valid, 0.125) * 2)


@needs_native
def test_int8_decode_operand_errors_are_clear():
    q, kc, vc, slots, valid = _case(9, 3, 64)
    op = torch.ops.llmserve_native.paged_decode_q8
    with pytest.raises(RuntimeError, match=r"rows of D \+ 4 in the int8 or fp8 cache"):
        op(q, kc[:, :, :64].contiguous(), vc[:, :, :64].contiguous(), slots, valid, 0.1, 0.0)
    with pytest.raises(RuntimeError, match="bf16 queries"):
        op(q.float(), kc, vc, slots, valid, 0.1, 0.0)
    with pytest.raises(RuntimeError, match="int8 or fp8 caches must be contiguous"):
        op(q, kc, vc[:100], slots, valid, 0.1, 0.0)
    with pytest.raises(RuntimeError, match="one shape and dtype"):
        op(q, kc, vc.view(torch.uint8).view(FP8), slots, valid, 0.1, 0.0)
    with pytest.raises(RuntimeError, match="slots"):
        op(q, kc, vc, slots[:, :10], valid, 0.1, 0.0)


@needs_native
def test_a_kernel_that_raises_in_its_self_test_is_not_used(monkeypatch, caplog):
    # a (query, cache) pair whose operator rejects its operands (bf16 over an fp16 cache,
    # routed here to paged_decode by hand): the self-test fails instead of raising, and no
    # later call finds the operator registered for the pair
    from llmserve.model.attention import native_decode

    monkeypatch.setattr(native_decode, "native_decode_kernel",
                        lambda dtype, kv_dtype=None: ("llmserve_native", "paged_decode"))
    with caplog.at_level("WARNING", logger="llmserve.model.attention.native_decode"):
        assert not native_decode.native_decode_serves(torch.bfloat16, torch.float16)
    assert "raised in its self-test" in caplog.text
    assert (torch.bfloat16, torch.float16) not in native_decode._PAGED_DECODE
    assert ops.self_test_results()["paged_decode_bfloat16_over_float16"] is False
    q, kc, vc, slots, valid = _case(9, 3, 64)
    with pytest.raises(RuntimeError, match="no native kernel for torch.bfloat16 queries"):
        native_decode.paged_decode_native(q, kc[:, :, :64].view(torch.float16)[:, :, :32]
                                          .contiguous(), vc, slots, valid, 0.1)
