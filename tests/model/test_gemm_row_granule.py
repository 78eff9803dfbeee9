"""PyTorch's dense GEMMs padded to a row granule: every row sums as it does alone
(llmserve.model.layers.gemm_row_granule; the products of dense weights no native kernel
takes, as on the ``none`` tier)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmserve.model.layers import cpu_kernels
from llmserve.model.layers.gemm_row_granule import GRANULES, find_granule, row_granule

#: Row counts of a step: one decode, small batches (MKL's 4-row remainders), a chunk
ROW_COUNTS = [*range(1, 20), 33, 67]


def _rows_alone_and_batched(product, x: torch.Tensor) -> list[int]:
    """The row counts at which some row of ``product`` differs from the row alone."""
    alone = torch.cat([product(x[i:i + 1]) for i in range(len(x))])
    return [m for m in ROW_COUNTS if not torch.equal(product(x[:m]), alone[:m])]


@pytest.mark.parametrize("k,n", [(576, 960), (4864, 896)])
def test_float32_linear_padded_to_its_granule_gives_every_row_its_bits_alone(k, n):
    """float32 ``F.linear`` (MKL): unpadded, a call of 2-12 rows sums its last ``M mod 4``
    rows with other kernels on an AVX-512 EPYC; padded to the self-tested granule, no row
    differs at any row count."""
    gen = torch.Generator().manual_seed(k)
    w = torch.randn(n, k, generator=gen)
    x = torch.randn(max(ROW_COUNTS), k, generator=gen)
    granule = row_granule("float32")
    assert granule in GRANULES

    def product(rows: torch.Tensor) -> torch.Tensor:
        return cpu_kernels.granular_linear(rows, w, None, granule)

    assert _rows_alone_and_batched(product, x) == []
    # the op is F.linear on the same rows: only the padding differs
    torch.testing.assert_close(product(x[:5]), F.linear(x[:5], w), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("dtype,k", [(torch.bfloat16, 4864), (torch.float32, 576)])
def test_onednn_packed_product_gives_every_row_its_bits_alone(dtype, k):
    """oneDNN's prepacked product (dense weights on tiers without a native product for
    them): unpadded, one row takes a matrix-vector path whose sums differ from larger calls'
    (float32 at every K, bf16 at K = 4864); ``packed_linear`` pads to the self-tested
    granule."""
    if not cpu_kernels.can_prepack(torch.zeros(2, 2, dtype=dtype)):
        pytest.skip(f"oneDNN {dtype} linear unavailable")
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(896, k, generator=gen).to(dtype)
    x = torch.randn(max(ROW_COUNTS), k, generator=gen).to(dtype)
    pid = cpu_kernels.prepack_linear(w)
    try:
        kind = cpu_kernels.packed_kind(pid)
        assert kind == {torch.bfloat16: "onednn-bf16", torch.float32: "onednn-float32"}[dtype]
        assert cpu_kernels.packed_row_granule(pid) == row_granule(kind) > 1
        assert _rows_alone_and_batched(lambda r: cpu_kernels.packed_linear(r, pid, 896), x) == []
        y = cpu_kernels.packed_linear(x[:3].view(3, 1, k), pid, 896)
        assert y.shape == (3, 1, 896)
        torch.testing.assert_close(y.view(3, 896).float(), (x[:3].float() @ w.float().T),
                                   rtol=0.05, atol=0.5)
    finally:
        cpu_kernels.release(pid)


def test_the_self_test_picks_the_smallest_granule_that_sums_rows_alone():
    """A product whose rows depend on the call's row count modulo 8 fails granules 2 and 4
    and passes 8; one that depends on the count itself passes none (1: not padded)."""
    def by_eighths(w: torch.Tensor):
        return lambda x: x @ w.T + (x.shape[0] % 8) * 1e-3

    def by_count(w: torch.Tensor):
        return lambda x: x @ w.T + x.shape[0] * 1e-3

    def broken(w: torch.Tensor):
        raise RuntimeError("no kernel")

    # x @ w.T itself is the float32 GEMM, padded here to the granule under test
    assert find_granule(by_eighths, torch.float32) == 8
    assert find_granule(by_count, torch.float32) == 1
    assert find_granule(broken, torch.float32) == 1


def test_fast_rounding_turns_the_padding_off_and_unknown_kinds_are_refused(monkeypatch):
    monkeypatch.setenv("LLMSERVE_FAST_ROUNDING", "1")
    assert row_granule("float32") == 1
    with pytest.raises(ValueError, match="unknown GEMM kind"):
        row_granule("float64")
    x, w = torch.randn(3, 8), torch.randn(5, 8)
    assert torch.equal(cpu_kernels.linear_rows(x, w, None, 1), F.linear(x, w))
