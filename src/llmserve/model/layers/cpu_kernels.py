"""CPU kernels behind custom ops: oneDNN-prepacked dense linears, padded GEMM rows.

oneDNN multiplies a bf16 or float32 weight stored in its own blocked layout at a much
higher share of the memory bandwidth than ``F.linear`` on the row-major layout (the step at
batch 1 is a chain of matrix-vector products, so that share is the step time). Both products
pad their rows to the row granule of their GEMM (gemm_row_granule), so a row sums the same
way at every row count. A packed weight is an
opaque oneDNN tensor that ``torch.compile`` cannot trace, so the product is a custom op
(``llmserve::packed_linear``) that takes the weight's registry id: compiled graphs call it as
an external kernel and fuse everything around it, eager code calls the same op.

The registry owns the packed tensors; a ``Linear`` releases its entry when it is deleted.
"""
from __future__ import annotations

import itertools
import logging
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from llmserve.model.layers.gemm_row_granule import (
    onednn_linear,
    onednn_pack,
    pad_rows,
    row_granule,
)

logger = logging.getLogger(__name__)

_packed_bytes: dict[int, int] = {}
_ids = itertools.count(1)
#: id -> (packed tensor, its row-granule kind (PACKED_KINDS), that kind's granule)
_owners: dict[int, tuple[torch.Tensor, str, int]] = {}
_probe_results: dict[torch.dtype, bool] = {}
#: weight dtypes oneDNN's prepacked product takes, and their row-granule kinds
PACKED_KINDS = {torch.bfloat16: "onednn-bf16", torch.float32: "onednn-float32"}


def _probe(dtype: torch.dtype = torch.bfloat16) -> bool:
    """oneDNN's linear in ``dtype`` works on this machine (checked once, on a tiny matrix)."""
    if dtype not in _probe_results:
        try:
            w = torch.randn(8, 16, dtype=dtype)
            x = torch.randn(2, 16, dtype=dtype)
            y = onednn_linear(x, onednn_pack(w))
            _probe_results[dtype] = bool(torch.allclose(y.float(), (x.float() @ w.float().T),
                                                        atol=0.1, rtol=0.05))
        except Exception as exc:  # noqa: BLE001 - any failure means: do not use it
            logger.info("oneDNN prepacked %s linear unavailable: %s", dtype, exc)
            _probe_results[dtype] = False
    return _probe_results[dtype]


def can_prepack(weight: torch.Tensor) -> bool:
    """Prepack bf16 and float32 CPU weights when oneDNN's linear works in their dtype."""
    return (weight.device.type == "cpu" and weight.dtype in PACKED_KINDS
            and torch.backends.mkldnn.is_available() and _probe(weight.dtype))


def prepack_linear(weight: torch.Tensor) -> int:
    """Pack ``weight (out, in)`` into oneDNN's layout; returns its id for ``packed_linear``.
    Its products pad their rows to the dtype's row granule (gemm_row_granule)."""
    kind = PACKED_KINDS[weight.dtype]
    pid = next(_ids)
    _owners[pid] = (onednn_pack(weight.contiguous()), kind, row_granule(kind))
    _packed_bytes[pid] = weight.numel() * weight.element_size()
    return pid


def packed_row_granule(pid: int) -> int:
    """The row granule the products of packed weight ``pid`` pad their calls to."""
    return _owners[pid][2]


def packed_kind(pid: int) -> str:
    """``onednn-bf16`` or ``onednn-float32``: the prepacked product of weight ``pid``."""
    return _owners[pid][1]


def release(pid: int) -> None:
    """Forget a packed weight (its module is gone)."""
    _owners.pop(pid, None)
    _packed_bytes.pop(pid, None)


def packed_bytes(pid: int) -> int:
    return _packed_bytes.get(pid, 0)


_LIB = torch.library.Library("llmserve", "FRAGMENT")


def cpu_op(schema: str, fake: Callable[..., torch.Tensor]):
    """Decorator: define the operator ``llmserve::<schema>`` with the decorated function as
    its CPU kernel and ``fake`` as its shape function (for ``torch.compile``); returns the
    operator. Compiled graphs call such an op from their wrapper as an external kernel.

    Plain ``Library`` registration, not ``torch.library.custom_op``: a call costs about half
    as much (custom_op adds Python layers), which counts at 121 dense linears in each of the
    default model's bf16 steps (docs/BENCHMARKS.md)."""
    name = schema.split("(", 1)[0]

    def register(fn: Callable[..., torch.Tensor]):
        _LIB.define(schema)
        _LIB.impl(name, fn, "CPU")
        torch.library.register_fake(f"llmserve::{name}", fake, lib=_LIB)
        return getattr(torch.ops.llmserve, name).default

    return register


def _packed_linear_fake(x: torch.Tensor, pid: int, out_features: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features)


@cpu_op("packed_linear(Tensor x, int pid, int out_features) -> Tensor", _packed_linear_fake)
def packed_linear(x: torch.Tensor, pid: int, out_features: int) -> torch.Tensor:
    """``x @ W^T`` for the prepacked weight ``pid`` (bf16 or float32), its rows padded to
    oneDNN's row granule (a row's sums never depend on the call's row count)."""
    owned = _owners.get(pid)
    if owned is None:
        raise RuntimeError(f"packed weight {pid} was released")
    weight, _, granule = owned
    shape = x.shape
    rows = x.reshape(-1, shape[-1])
    y = onednn_linear(pad_rows(rows, granule), weight)
    return y[:rows.shape[0]].reshape(*shape[:-1], out_features)


def _granular_linear_fake(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                          granule: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@cpu_op("granular_linear(Tensor x, Tensor weight, Tensor? bias, int granule) -> Tensor",
        _granular_linear_fake)
def granular_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                    granule: int) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` over ``x``'s rows padded to a multiple of ``granule``
    (gemm_row_granule: a row's sums never depend on the call's row count)."""
    shape = x.shape
    rows = x.reshape(-1, shape[-1])
    y = F.linear(pad_rows(rows, granule), weight)[:rows.shape[0]]   # the self-tested product
    if bias is not None:
        y = y + bias
    return y.reshape(*shape[:-1], weight.shape[0])


def linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                granule: int) -> torch.Tensor:
    """``F.linear`` where rows need no padding (``granule`` 1, or not a CPU tensor),
    :func:`granular_linear` otherwise."""
    if granule <= 1 or x.device.type != "cpu":
        return F.linear(x, weight, bias)
    return granular_linear(x, weight, bias, granule)


def _rows_copy_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@cpu_op("rows_copy(Tensor x) -> Tensor", _rows_copy_fake)
def rows_copy(x: torch.Tensor) -> torch.Tensor:
    """A copy of ``x`` that a compiled graph cannot fuse with what reads it (see
    :func:`stored_rows`)."""
    return x.clone()


def stored_rows(h: torch.Tensor) -> torch.Tensor:
    """``h`` stored before the next op reads it, inside a compiled CPU graph (as is in eager
    code and on other devices): a value every layer reads (the decode step's key table and
    mask) is then computed once, not inlined into each reader's loop."""
    if torch.compiler.is_compiling() and h.device.type == "cpu":
        return rows_copy(h)
    return h
