"""RMSNorm, plain and in Gemma's ``1 + w`` form."""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.model.layers.compiled_rows import WARMUP_ROWS, compile_rows, many_rows


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


class RMSNorm(nn.Module):
    """``x / rms(x) * weight`` over the last dimension (computed by ``F.rms_norm``; compiled
    for many rows outside a compiled graph once :meth:`compile_rows` ran: on many bf16 rows
    the eager CPU kernel is far slower than the compiled one, docs/BENCHMARKS.md)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device),
                                   requires_grad=False)
        self.size = size
        self.eps = eps
        self.rows_norm: Optional[Callable[..., torch.Tensor]] = None   # compile_rows

    def compile_rows(self, dtype: torch.dtype, device: torch.device) -> bool:
        """Take the compiled many-row norm (one graph per eps value, shared by every norm)."""
        x = torch.zeros(WARMUP_ROWS, self.size, dtype=dtype, device=device)
        self.rows_norm = compile_rows(_rms_norm, x, torch.ones_like(x[0]), self.eps)
        return self.rows_norm is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rows_norm is not None and x.dim() == 2 and many_rows(x.shape[0]):
            return self.rows_norm(x, self.weight, self.eps)
        return F.rms_norm(x, (self.size,), self.weight, self.eps)

    def load(self, name: str, tensor: torch.Tensor, shard: object = None) -> None:
        if name != "weight" or tuple(tensor.shape) != (self.size,):
            raise ValueError(f"RMSNorm({self.size}) cannot load {name} of shape {tuple(tensor.shape)}")
        self.weight.data.copy_(tensor)


class OffsetRMSNorm(RMSNorm):
    """Gemma's RMSNorm: ``x / rms(x) * (1 + w)`` for a checkpoint weight ``w``.

    The parameter holds ``1 + w`` (added once at load), so the forward pass is the plain
    ``F.rms_norm`` and a fresh module (checkpoint ``w = 0``) is the identity scale.
    """

    def load(self, name: str, tensor: torch.Tensor, shard: object = None) -> None:
        super().load(name, tensor.float() + 1.0)
