"""RMSNorm, plain and in Gemma's ``1 + w`` form, with one summation order on every path.

A norm's sum of squares is a reduction, and the order of a float reduction is the
implementation's choice: ATen's kernel, inductor's loop inside a compiled decode graph and
inductor's loop in a dynamic many-row graph each pick their own, per shape. A row normed in
a prefill chunk of 64 rows then differed by an ulp or two from the same row normed alone,
and on the default model that moved logits by up to 1.1 (tests/model/test_batch_invariance.py).

So on CPU every path of a model (the compiled decode and verify steps, eager prefill chunks
of any row count) calls one function, picked once when the norm is built
(:func:`rows_norm_kernel`): the tier library's ``rms_norm`` (``csrc/portable/rms_norm.cpp``:
a fixed order, the same bits on every tier) where a library is loaded, else
``llmserve::torch_rms_norm``, ATen's kernel behind a custom op that compiled graphs call as
it is instead of tracing (ATen sums each row on its own, whatever the row count). Both are
opaque to inductor, so no graph can reorder a row's sum. Other devices keep ``F.rms_norm``.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.model.layers.cpu_kernels import cpu_op

#: A rows norm: ``(x (T, n) with contiguous rows, weight (n,), eps) -> (T, n)``
RowsNorm = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]

#: The tier library's ``rms_norm`` operator (set once by :func:`rows_norm_kernel`)
_NATIVE_NORM: Optional[Any] = None


def native_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The CPU tier library's ``rms_norm`` (``csrc/portable/rms_norm.cpp``). A module holds
    this function, not the operator: an operator object gains attributes as it is used, and
    a saved graph's key includes what the model's modules hold (graph_store.py)."""
    if _NATIVE_NORM is None:
        raise RuntimeError("native_rms_norm needs rows_norm_kernel() to have found the library")
    return _NATIVE_NORM(x, weight, eps)


def _torch_rms_norm_fake(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@cpu_op("torch_rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", _torch_rms_norm_fake)
def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """ATen's ``F.rms_norm`` as one opaque op: the same kernel in eager code and in every
    compiled graph."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def _self_test(norm: RowsNorm) -> bool:
    """``norm`` against ``F.rms_norm`` (bf16 and float32 rows, an odd width, a zero row,
    infinities and NaN), and each row the same alone as among 37."""
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        x = (torch.randn(37, 203, generator=gen) * 4).to(dtype)
        x[1] = 0
        x[2, 5], x[3, 7] = float("inf"), float("nan")
        w = (torch.rand(203, generator=gen) + 0.5).to(dtype)
        got = norm(x, w, 1e-5)
        want = F.rms_norm(x, (203,), w, 1e-5)
        if not torch.allclose(got.float(), want.float(), rtol=2 ** -7, atol=1e-6, equal_nan=True):
            return False
        alone = torch.cat([norm(x[i:i + 1], w, 1e-5) for i in range(len(x))])
        bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
        if not torch.equal(alone.view(bits), got.view(bits)):
            return False
    return True


def rows_norm_kernel(dtype: torch.dtype, device: "torch.device | str | None") -> RowsNorm:
    """The norm every path of a model with ``dtype`` rows on ``device`` calls: the CPU
    tier library's ``rms_norm`` (bf16 / float32, self-tested once per process), else
    :func:`torch_rms_norm` on CPU, else ``F.rms_norm``'s rows form."""
    from llmserve.model.native.ops import kernel_checked, tier_ops

    global _NATIVE_NORM
    if device is not None and torch.device(device).type != "cpu":
        return torch_free_rms_norm
    ops = tier_ops() if dtype in (torch.bfloat16, torch.float32) else None
    if ops is not None:
        if _NATIVE_NORM is None:
            _NATIVE_NORM = ops.rms_norm
        if kernel_checked("rms_norm", lambda: _self_test(native_rms_norm), library=lambda: True):
            return native_rms_norm
    return torch_rms_norm


def torch_free_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``F.rms_norm`` of rows (devices other than CPU)."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def rows_norm_name(fn: RowsNorm) -> str:
    """How the kernel plan names a rows norm."""
    if fn is torch_rms_norm:
        return "torch rms_norm (one op on every path)"
    if fn is native_rms_norm:
        from llmserve.model.native.ops import tier_library

        return f"native rms_norm ({tier_library()})"
    return "torch rms_norm"


class RMSNorm(nn.Module):
    """``x / rms(x) * weight`` over the last dimension, by :attr:`rows_norm` (one function
    for every path of the model: see the module docstring)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device),
                                   requires_grad=False)
        self.size = size
        self.eps = eps
        self.rows_norm: RowsNorm = rows_norm_kernel(dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.size)
        if rows.stride(-1) != 1 or (rows.shape[0] > 1 and rows.stride(0) < self.size):
            rows = rows.contiguous()
        return self.rows_norm(rows, self.weight, self.eps).view(x.shape)

    def load(self, name: str, tensor: torch.Tensor, shard: object = None) -> None:
        if name != "weight" or tuple(tensor.shape) != (self.size,):
            raise ValueError(f"RMSNorm({self.size}) cannot load {name} of shape {tuple(tensor.shape)}")
        self.weight.data.copy_(tensor)


class OffsetRMSNorm(RMSNorm):
    """Gemma's RMSNorm: ``x / rms(x) * (1 + w)`` for a checkpoint weight ``w``.

    The parameter holds ``1 + w`` (added once at load), so the forward pass is the plain
    norm and a fresh module (checkpoint ``w = 0``) is the identity scale.
    """

    def load(self, name: str, tensor: torch.Tensor, shard: object = None) -> None:
        super().load(name, tensor.float() + 1.0)
