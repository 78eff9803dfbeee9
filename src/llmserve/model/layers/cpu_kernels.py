"""CPU kernels behind custom ops: oneDNN-prepacked dense linears.

oneDNN multiplies a bf16 weight stored in its own blocked layout at a much higher share of
the memory bandwidth than ``F.linear`` on the row-major layout (the step at batch 1 is a
chain of matrix-vector products, so that share is the step time). A packed weight is an
opaque oneDNN tensor that ``torch.compile`` cannot trace, so the product is a custom op
(``llmserve::packed_linear``) that takes the weight's registry id: compiled graphs call it as
an external kernel and fuse everything around it, eager code calls the same op.

The registry owns the packed tensors; a ``Linear`` releases its entry when it is deleted.
"""
from __future__ import annotations

import itertools
import logging
from typing import Callable

import torch

logger = logging.getLogger(__name__)

_packed_bytes: dict[int, int] = {}
_ids = itertools.count(1)
_owners: dict[int, torch.Tensor] = {}  # id -> packed tensor
_probe_result: "bool | None" = None


def _probe() -> bool:
    """oneDNN bf16 linear works on this machine (checked once, on a tiny matrix)."""
    global _probe_result
    if _probe_result is None:
        try:
            w = torch.randn(8, 16, dtype=torch.bfloat16)
            x = torch.randn(2, 16, dtype=torch.bfloat16)
            packed = torch.ops.mkldnn._reorder_linear_weight(w, 1)
            y = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
            _probe_result = bool(torch.allclose(y.float(), (x.float() @ w.float().T),
                                                atol=0.1, rtol=0.05))
        except Exception as exc:  # noqa: BLE001 - any failure means: do not use it
            logger.info("oneDNN prepacked linear unavailable: %s", exc)
            _probe_result = False
    return _probe_result


def can_prepack(weight: torch.Tensor) -> bool:
    """Prepack bf16 CPU weights when oneDNN is usable."""
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16
            and torch.backends.mkldnn.is_available() and _probe())


def prepack_linear(weight: torch.Tensor) -> int:
    """Pack ``weight (out, in)`` into oneDNN's layout; returns its id for ``packed_linear``."""
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 1)
    pid = next(_ids)
    _owners[pid] = packed
    _packed_bytes[pid] = weight.numel() * weight.element_size()
    return pid


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
    """``x @ W^T`` for the prepacked weight ``pid`` (bf16)."""
    weight = _owners.get(pid)
    if weight is None:
        raise RuntimeError(f"packed weight {pid} was released")
    shape = x.shape
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, shape[-1]), weight, None, "none", [], "")
    return y.view(*shape[:-1], out_features)


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
