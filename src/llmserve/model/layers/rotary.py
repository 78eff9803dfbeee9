"""Rotary position embeddings, including Llama-3 frequency scaling.

Q/K stay in Hugging Face's half-split layout (GGUF files are un-permuted to it at load), so
checkpoints load without any row permutation.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn


def rope_inv_freq(head_dim: int, theta: float, scaling: Optional[dict]) -> torch.Tensor:
    """Inverse frequencies (head_dim/2,), with "llama3" / "linear" scaling applied."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in (None, "default"):
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen = old_len / low
        high_wavelen = old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_mid, mid, scaled)
    raise ValueError(f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    """Rotates q and k in Hugging Face's half-split layout with a precomputed cos/sin table.

    Per head, dims ``[0, d/2)`` and ``[d/2, d)`` form the rotating pairs ``(x_i, y_i)``::

        x' = x cos(p w_i) - y sin(p w_i)        y' = y cos(p w_i) + x sin(p w_i)

    The table is ``(max_positions, head_dim)`` float32: cos in the first half, sin in the
    second; one row lookup per token, real arithmetic only (compile-friendly).
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: Optional[dict], device: torch.device) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary head_dim must be even, got {head_dim}")
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        pos = torch.arange(max_positions, dtype=torch.float64)
        angles = torch.outer(pos, inv_freq)
        table = torch.cat([angles.cos(), angles.sin()], -1).to(torch.float32)
        self.register_buffer("cos_sin", table.to(device), persistent=False)
        self.half = head_dim // 2

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``q (T, Hq, D)``, ``k (T, Hkv, D)`` rotated to their positions ``(T,)``."""
        cs = self.cos_sin.index_select(0, positions).unsqueeze(1)      # (T, 1, D)
        cos, sin = cs[..., :self.half], cs[..., self.half:]
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)
