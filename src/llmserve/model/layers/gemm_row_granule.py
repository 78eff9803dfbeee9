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
self-test: the smallest of :data:`GRANULES` for which every row of calls of 1 to 2g + 1 rows
and of 67 rows (each padded) equals the same row alone (padded), on a short and a long
reduction. Where none passes, calls are not padded; this is logged, and the kernel plan
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
#: (K, N) of the self-test's weights: a short reduction and a long one (wide enough that
#: oneDNN's bf16 one-row sums at K = 4864 differ in some output in every seed tried)
_SELF_TEST_SHAPES = ((576, 384), (4864, 512))
_SELF_TEST_ROWS = 67
_granules: dict[str, int] = {}

RowProduct = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def pad_rows(x: torch.Tensor, granule: int) -> torch.Tensor:
    """``x (M, K)`` with zero rows appended up to a multiple of ``granule``."""
    return F.pad(x, (0, 0, 0, (-x.shape[0]) % granule))


def _onednn_product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 1)
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def _products() -> dict[str, tuple[torch.dtype, RowProduct]]:
    return {
        "float32": (torch.float32, lambda x, w: F.linear(x, w)),
        "bfloat16": (torch.bfloat16, lambda x, w: F.linear(x, w)),
        "float16": (torch.float16, lambda x, w: F.linear(x, w)),
        "onednn-bf16": (torch.bfloat16, _onednn_product),
        "onednn-float32": (torch.float32, _onednn_product),
    }


def rows_sum_alone(product: RowProduct, x: torch.Tensor, w: torch.Tensor,
                   granule: int) -> bool:
    """Every row of ``product`` over calls of 1 to ``2 * granule + 1`` rows and of all of
    ``x``'s rows, each call padded to ``granule``, equals the same row computed alone."""
    alone = torch.cat([product(pad_rows(x[i:i + 1], granule), w)[:1] for i in range(len(x))])
    for m in [*range(1, 2 * granule + 2), len(x)]:
        if not torch.equal(product(pad_rows(x[:m], granule), w)[:m], alone[:m]):
            return False
    return True


def find_granule(product: RowProduct, dtype: torch.dtype, name: str = "") -> int:
    """The smallest of :data:`GRANULES` at which ``product`` (``(x, w) -> x @ w.T``) sums
    every row of the self-test's calls as the row alone, in ``dtype``; 1 where none does or
    the product raises (logged)."""
    gen = torch.Generator().manual_seed(0)
    cases = [(torch.randn(_SELF_TEST_ROWS, k, generator=gen).to(dtype),
              torch.randn(n, k, generator=gen).to(dtype)) for k, n in _SELF_TEST_SHAPES]
    try:
        for granule in GRANULES:
            if all(rows_sum_alone(product, x, w, granule) for x, w in cases):
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
    if kind not in _granules:
        dtype, product = _products()[kind]
        _granules[kind] = find_granule(product, dtype, kind)
        logger.info("PyTorch %s GEMM: rows padded to a multiple of %d", kind, _granules[kind])
    return _granules[kind]
