"""The rows norm every path of a CPU model calls (``csrc/portable/rms_norm.cpp``, built into
each tier's library; ``llmserve::torch_rms_norm`` without one): PyTorch's ``F.rms_norm``
within a bf16 rounding at widths across its 16 accumulators' boundaries, NaN and infinity
confined to their rows, each row's bits the same alone as among any number of rows and
across the AVX-512 and avx2 builds, and the module picking its function once."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmserve.model.layers.norm import RMSNorm, rows_norm_kernel, torch_rms_norm
from llmserve.model.native import ops
from llmserve.model.platform import cpu_flags
from tests.model.native import needs_native

BITS = {torch.bfloat16: torch.int16, torch.float32: torch.int32}


def _rows(rows: int, n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    x = (torch.randn(rows, n, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype)
    if rows > 3:
        x[1] = 0                          # a zero row: 0 * 1/sqrt(eps)
        x[2, n // 2] = float("inf")       # an infinity: its row 0 and NaN
        x[3, 0] = float("nan")            # a NaN poisons its row only
    return x


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(BITS[a.dtype]), b.view(BITS[b.dtype]))


@needs_native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n", [1, 15, 16, 17, 64, 203, 576, 2048])
def test_native_norm_follows_pytorch_and_keeps_each_rows_bits(dtype, n):
    norm = torch.ops.llmserve_native.rms_norm
    x = _rows(70, n, dtype, n)
    w = (torch.rand(n, generator=torch.Generator().manual_seed(1)) + 0.5).to(dtype)
    got = norm(x, w, 1e-6)
    want = F.rms_norm(x, (n,), w, 1e-6)
    rtol = 2 ** -7 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got, want, rtol=rtol, atol=1e-6, equal_nan=True)
    assert torch.isnan(got[3]).all() and torch.isfinite(got[4:]).all()
    assert (got[1] == 0).all()
    for count in (1, 2, 5, 64):           # the same bits however many rows share a call
        parts = torch.cat([norm(x[i:i + count], w, 1e-6) for i in range(0, len(x), count)])
        assert _same_bits(parts, got)
    strided = torch.cat([x, x], 1)[:, :n]  # rows with a stride of 2n
    assert _same_bits(norm(strided, w, 1e-6), got)


@needs_native
def test_native_norm_rejects_what_it_cannot_take():
    norm = torch.ops.llmserve_native.rms_norm
    x = torch.randn(4, 32).bfloat16()
    with pytest.raises(RuntimeError, match="weight must be"):
        norm(x, torch.ones(31, dtype=torch.bfloat16), 1e-6)
    with pytest.raises(RuntimeError, match="weight must be"):
        norm(x, torch.ones(32), 1e-6)                     # float32 weight, bf16 rows
    with pytest.raises(RuntimeError, match="bf16 or float32"):
        norm(x.half(), torch.ones(32, dtype=torch.half), 1e-6)
    with pytest.raises(RuntimeError, match="contiguous rows"):
        norm(x.t(), torch.ones(4, dtype=torch.bfloat16), 1e-6)


@pytest.mark.skipif(not (ops.CPU_TIERS["avx2"] <= cpu_flags()) or ops._compiler() is None
                    or not ops.native_available(),
                    reason="needs both the AVX-512 and the avx2 library")
def test_the_avx2_build_gives_the_avx512_builds_bits():
    path = ops.build(ops._compiler(), "llmserve_avx2", ops.AVX2_SOURCES, ops.AVX2_HEADERS,
                     ops._AVX2_FLAGS)
    torch.ops.load_library(str(path))
    for dtype in (torch.bfloat16, torch.float32):
        x = _rows(40, 576, dtype, 7)
        w = (torch.rand(576) + 0.5).to(dtype)
        assert _same_bits(torch.ops.llmserve_avx2.rms_norm(x, w, 1e-5),
                          torch.ops.llmserve_native.rms_norm(x, w, 1e-5))


def test_the_torch_norm_is_one_op_with_each_rows_bits():
    """Without a library (the none tier) the norm is ATen's behind one custom op: a
    compiled graph calls it instead of tracing a norm of its own, and ATen sums each row
    the same way at every row count."""
    x = _rows(70, 576, torch.bfloat16, 3)
    w = (torch.rand(576) + 0.5).bfloat16()
    alone = torch.cat([torch_rms_norm(x[i:i + 1], w, 1e-6) for i in range(len(x))])
    assert _same_bits(torch_rms_norm(x, w, 1e-6), alone)
    torch._dynamo.reset()
    compiled = torch.compile(lambda t: torch_rms_norm(t, w, 1e-6) * 2, dynamic=True)
    assert _same_bits(compiled(x[4:]), alone[4:] * 2)


def test_a_norm_module_picks_its_function_once():
    native = ops.tier_ops() is not None
    norm = RMSNorm(64, 1e-6, torch.bfloat16, torch.device("cpu"))
    assert (norm.rows_norm is torch_rms_norm) != native
    assert rows_norm_kernel(torch.float16, "cpu") is torch_rms_norm     # no half kernel
    x = torch.randn(3, 5, 64).bfloat16()[:, 1:4]                         # (T, H, D) view
    torch.testing.assert_close(norm(x), F.rms_norm(x, (64,), norm.weight, 1e-6), rtol=2 ** -7,
                               atol=1e-6)
