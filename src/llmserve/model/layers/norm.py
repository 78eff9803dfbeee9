"""RMSNorm and the gated SiLU activation of Llama-family MLPs."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """``x / rms(x) * weight`` over the last dimension (computed by ``F.rms_norm``)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device),
                                   requires_grad=False)
        self.size = size
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (self.size,), self.weight, self.eps)

    def load(self, name: str, tensor: torch.Tensor, shard: object = None) -> None:
        if name != "weight" or tuple(tensor.shape) != (self.size,):
            raise ValueError(f"RMSNorm({self.size}) cannot load {name} of shape {tuple(tensor.shape)}")
        self.weight.data.copy_(tensor)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for a fused ``[gate | up]`` projection output."""
    gate, up = gate_up.chunk(2, -1)
    return F.silu(gate) * up
