"""PyTorch's dense GEMMs with one summation order per row: calls padded to a row granule.

Dense weights that no native product takes multiply by PyTorch's own GEMMs: oneDNN's
prepacked product (bf16 and float32 weights, :mod:`cpu_kernels`), or ``F.linear`` (MKL's
sgemm for float32) where oneDNN is unusable. That is every dense linear on the ``none`` tier
(no kernel library), and a bf16 weight on a tier without the bf16 kernel. Both GEMMs sum a
row differently by the row count of the call. Measured on an AVX-512 EPYC:

- MKL gives the last ``M mod 4`` rows of a call of fewer than 13 rows other kernels;
- oneDNN takes a matrix-vector path for one row, whose sums differ from those of larger
  calls (float32 at every K; bf16 at long reductions, K = 2048 and 4864).

So a sequence's logits followed its batch there. A call padded with zero rows to a multiple
of a small granule never meets those cases: each row then sums as it does alone.

The granule is not assumed. :func:`row_granule` finds it once per process and kind, by a
self-test (per thread count): the smallest of :data:`GRANULES` for which every row of calls
of 1 to 2g + 1 rows, and every seventh row of a call of 259 rows (each call padded), equals
the same row alone (padded), on a short, a long and a LoRA-sized reduction. It samples shapes and row counts; it does not
prove every call. Where none passes, calls are not padded; this is logged, and the kernel plan
reports a granule of 1. ``LLMSERVE_FAST_ROUNDING=1`` turns the padding off, as it turns off
the rest of the exactness work. The padded products are ops of :mod:`cpu_kernels`
(``packed_linear``, ``granular_linear``), so eager and compiled steps pad alike.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch
import torch.nn.functional as F

from llmserve.model.platform import env_flag

logger = logging.getLogger(__name__)

#: Row granules tried, smallest first (a 1-row decode costs a call of this many rows)
GRANULES = (2, 4, 8, 16, 32)
#: (K, N) of the self-test's weights: a short reduction, a long one (wide enough that
#: oneDNN's bf16 one-row sums at K = 4864 differ in some output in every seed tried) and a
#: LoRA-sized one (rank columns in, a projection's width out)
_SELF_TEST_SHAPES = ((576, 384), (4864, 512), (48, 576))
#: the largest call of the self-test (a prefill chunk's rows)
_SELF_TEST_ROWS = 259
_granules: dict[tuple[str, int], int] = {}   # (kind, torch threads) -> granule

#: ``rows -> rows @ w.T`` for one weight ``w``
RowsProduct = Callable[[torch.Tensor], torch.Tensor]
#: a weight -> its :data:`RowsProduct` (a packed product packs the weight once)
WeightProduct = Callable[[torch.Tensor], RowsProduct]


def pad_rows(x: torch.Tensor, granule: int) -> torch.Tensor:
    """``x (M, K)`` with zero rows appended up to a multiple of ``granule`` (``x`` itself
    where ``M`` is one already)."""
    pad = (-x.shape[0]) % granule
    return F.pad(x, (0, 0, 0, pad)) if pad else x


def dtype_kind(dtype: torch.dtype) -> str:
    """``float32``, ``bfloat16``, ...: the name of a dtype as the GEMM kinds spell it."""
    return str(dtype).removeprefix("torch.")


def onednn_pack(w: torch.Tensor) -> torch.Tensor:
    """``w (N, K)`` in oneDNN's blocked layout for :func:`onednn_linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(w, 1)


def onednn_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """``x (M, K) @ W^T`` by oneDNN for an :func:`onednn_pack` weight (rows as given)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def _onednn_product(w: torch.Tensor) -> RowsProduct:
    packed = onednn_pack(w)
    return lambda x: onednn_linear(x, packed)


def _linear_product(w: torch.Tensor) -> RowsProduct:
    return lambda x: F.linear(x, w)


def _products() -> dict[str, tuple[torch.dtype, WeightProduct]]:
    return {
        "float32": (torch.float32, _linear_product),
        "bfloat16": (torch.bfloat16, _linear_product),
        "float16": (torch.float16, _linear_product),
        "onednn-bf16": (torch.bfloat16, _onednn_product),
        "onednn-float32": (torch.float32, _onednn_product),
    }


def rows_sum_alone(product: RowsProduct, x: torch.Tensor, granule: int) -> bool:
    """Every row of ``product`` over calls of 1 to ``2 * granule + 1`` rows, and every
    seventh row and the last rows of a call of all ``x``'s rows, each call padded to
    ``granule``, equals the same row computed alone."""
    small = 2 * granule + 1
    picked = sorted({*range(small), *range(small, len(x), 7), *range(len(x) - 3, len(x))})
    alone = {i: product(pad_rows(x[i:i + 1], granule))[0] for i in picked}
    for m in range(1, small + 1):
        got = product(pad_rows(x[:m], granule))
        if not all(torch.equal(got[i], alone[i]) for i in range(m)):
            return False
    got = product(pad_rows(x, granule))
    return all(torch.equal(got[i], alone[i]) for i in picked)


def find_granule(product: WeightProduct, dtype: torch.dtype, name: str = "") -> int:
    """The smallest of :data:`GRANULES` at which ``product`` (a weight ``w`` -> the product
    ``rows -> rows @ w.T``) sums every row of the self-test's calls as the row alone, in
    ``dtype``; 1 where none does or the product raises (logged)."""
    gen = torch.Generator().manual_seed(0)
    try:
        cases = []
        for k, n in _SELF_TEST_SHAPES:
            x = torch.randn(_SELF_TEST_ROWS, k, generator=gen).to(dtype)
            cases.append((product(torch.randn(n, k, generator=gen).to(dtype)), x))
        for granule in GRANULES:
            if all(rows_sum_alone(rows_product, x, granule) for rows_product, x in cases):
                return granule
    except Exception as exc:  # noqa: BLE001 - a product that fails here is not padded
        logger.warning("row-granule self-test of %s raised: %s", name or product, exc)
        return 1
    logger.warning("PyTorch's %s GEMM sums rows by the row count at every granule of %s: its "
                   "rows are not padded and their logits may follow the batch", name or product,
                   GRANULES)
    return 1


def row_granule(kind: str) -> int:
    """The row granule of PyTorch's GEMM ``kind`` (``float32``, ``bfloat16``, ``float16``:
    ``F.linear`` in that dtype; ``onednn-bf16``, ``onednn-float32``: the prepacked product),
    found once per process; 1 (no padding) under ``LLMSERVE_FAST_ROUNDING=1`` or where no
    granule passes."""
    if kind not in _products():
        raise ValueError(f"unknown GEMM kind {kind!r}; one of {sorted(_products())}")
    if env_flag("LLMSERVE_FAST_ROUNDING"):
        return 1
    key = (kind, torch.get_num_threads())   # a GEMM may split its work otherwise
    if key not in _granules:
        dtype, product = _products()[kind]
        _granules[key] = find_granule(product, dtype, kind)
        logger.info("PyTorch %s GEMM: rows padded to a multiple of %d", kind, _granules[key])
    return _granules[key]
