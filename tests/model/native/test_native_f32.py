"""The float32 dense product (``csrc/portable/f32_gemm.cpp``, built into each tier's library):
the float64 product within float32 rounding, each row's bits the same alone as among any
number of rows (PyTorch's float32 GEMM is not: its sums move with the row count), NaN
confined to its row, and a dense float32 linear and tied head packing for it."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmserve.model.layers.native_dense import (
    can_pack_native,
    f32_mm,
    native_f32_available,
    native_mm,
    pack_f32,
    pack_native,
)
from llmserve.model.native import ops
from llmserve.model.platform import cpu_flags
from tests.model.native import needs_native


def _operands(rows: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen) / k ** 0.5


def _check(op, rows: int, n: int, k: int) -> None:
    x, w = _operands(rows, n, k, rows * 7 + n + k)
    x[2, k // 2] = float("nan")                 # a NaN poisons its own row only
    packed = pack_f32(w)
    assert packed.shape == (-(-n // 16), k * 16)
    y = op(x, packed)[:, :n]
    want = (x.double() @ w.double().T).float()
    assert torch.isnan(y[2]).all() and not torch.isnan(y[torch.arange(rows) != 2]).any()
    keep = torch.arange(rows) != 2
    torch.testing.assert_close(y[keep], want[keep], rtol=1e-5, atol=1e-5 * k ** 0.5)
    for count in (1, 2, 3, 5, 6, 7, 64):        # the same bits however many rows share a call
        parts = torch.cat([op(x[i:i + count].contiguous(), packed)[:, :n]
                           for i in range(0, rows, count)])
        assert torch.equal(parts.nan_to_num(), y.nan_to_num()), count


@needs_native
@pytest.mark.parametrize("n,k", [(16, 1), (40, 67), (576, 1536), (1000, 576)])
def test_f32_mm_follows_float64_and_keeps_each_rows_bits(n, k):
    _check(torch.ops.llmserve_native.f32_mm, 70, n, k)


@pytest.mark.skipif(not ops.CPU_TIERS["avx2"] <= cpu_flags() or ops._compiler() is None,
                    reason="needs AVX2 + FMA + F16C and a C++ compiler")
@pytest.mark.parametrize("n,k", [(16, 1), (40, 67), (1000, 576)])
def test_the_avx2_build_follows_float64_and_keeps_each_rows_bits(n, k):
    path = ops.build(ops._compiler(), "llmserve_avx2", ops.AVX2_SOURCES, ops.AVX2_HEADERS,
                     ops._AVX2_FLAGS)
    torch.ops.load_library(str(path))
    _check(torch.ops.llmserve_avx2.f32_mm, 70, n, k)
    if ops.native_available():   # one fused multiply-add a k in both: the same bits
        x, w = _operands(70, n, k, 9)
        packed = pack_f32(w)
        assert torch.equal(torch.ops.llmserve_avx2.f32_mm(x, packed),
                           torch.ops.llmserve_native.f32_mm(x, packed))


@needs_native
def test_f32_mm_keeps_the_rows_that_pytorchs_float32_gemm_moves():
    """Why the kernel exists: F.linear sums a row differently at some row counts on this
    CPU (1, 2, 3 and 5 rows of 64 here); f32_mm gives every row count the batch's bits."""
    x, w = _operands(64, 1536, 576, 0)
    full, packed = F.linear(x, w), pack_f32(w)
    mine = f32_mm(x, packed, 1536)
    moved = [m for m in range(1, 17) if not torch.equal(F.linear(x[:m], w), full[:m])]
    assert not [m for m in range(1, 17) if not torch.equal(f32_mm(x[:m], packed, 1536),
                                                           mine[:m])], moved


@needs_native
def test_a_float32_weight_packs_for_the_tier_product_and_bf16_for_its_own():
    assert native_f32_available()
    x, w = _operands(9, 50, 64, 3)
    assert can_pack_native(w) and can_pack_native(w.bfloat16())
    assert not can_pack_native(w.half())
    packed = pack_native(w)
    assert packed.dtype == torch.float32
    torch.testing.assert_close(native_mm(x, packed, 50), f32_mm(x, packed, 50))
    y = native_mm(x.view(3, 3, 64), packed, 50)        # leading dims kept, padding cut
    assert y.shape == (3, 3, 50)
    torch.testing.assert_close(y.view(9, 50), (x.double() @ w.double().T).float(),
                               rtol=1e-5, atol=1e-5)
    assert pack_native(w.bfloat16()).dtype == torch.bfloat16


@needs_native
def test_a_tied_float32_table_is_held_once_as_strips():
    """A tied float32 head packs the table for f32_mm; the embedding then looks its rows up
    in those strips (the row-major copy is dropped), with the table's exact values."""
    from llmserve.model.layers.embedding import LMHead, VocabEmbedding
    from llmserve.model.layers.linear import DenseLinearMethod

    vocab, hidden = 100, 48
    emb = VocabEmbedding(vocab, hidden, torch.float32, torch.device("cpu"))
    table = torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(4))
    emb.load("weight", table)
    head = LMHead(vocab, hidden, tied_to=emb, method=DenseLinearMethod(), dtype=torch.float32,
                  device=torch.device("cpu"))
    head.finish_loading()
    assert emb.weight is None and emb.strips is head.native_head
    assert emb.weight_bytes == 0 and head.extra_bytes == 112 * hidden * 4   # 7 strips
    ids = torch.tensor([[0, 15, 16], [99, 42, 3]])
    assert torch.equal(emb(ids), table[ids])
    x = torch.randn(5, hidden)
    torch.testing.assert_close(head(x), (x.double() @ table.double().T).float(),
                               rtol=1e-5, atol=1e-5)


@needs_native
def test_f32_mm_rejects_operands_of_the_wrong_shape_or_dtype():
    x, w = _operands(4, 32, 64, 5)
    packed = pack_f32(w)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.llmserve_native.f32_mm(x.bfloat16(), packed)
    with pytest.raises(RuntimeError, match="K = 63"):
        torch.ops.llmserve_native.f32_mm(x[:, :63].contiguous(), packed)
