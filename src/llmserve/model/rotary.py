"""Rotary position embeddings, including Llama-3 frequency scaling.

The model keeps Q/K head dims in the *interleaved* pair layout (dims 2i, 2i+1 form one
rotating pair), so rotation is one complex multiply. Checkpoints in Hugging Face's
half-split layout are permuted at load (`to_interleaved_rows`); attention scores are
unchanged because Q and K are permuted alike.
"""
from __future__ import annotations

import math
from typing import Optional

import torch


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


class RotaryEmbedding:
    """Precomputed unit complex rotations for every position up to ``max_positions``."""

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: Optional[dict], device: torch.device) -> None:
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        pos = torch.arange(max_positions, dtype=torch.float64)
        angles = torch.outer(pos, inv_freq)
        self.cis = torch.polar(torch.ones_like(angles), angles).to(torch.complex64).to(device)

    def for_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """(T, 1, head_dim/2) complex rotations, broadcast over heads."""
        return self.cis.index_select(0, positions).unsqueeze(1)


def apply_rotary(x: torch.Tensor, cis: torch.Tensor) -> torch.Tensor:
    """Rotate (T, heads, head_dim) in interleaved-pair layout by (T, 1, head_dim/2) rotations."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * cis).flatten(-2).to(x.dtype)


def to_interleaved_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Permute the output rows of a Q/K projection from half-split to interleaved pairs.

    Within each head, HF order is [x0..x_{d/2-1}, y0..y_{d/2-1}] (pair i = (x_i, y_i));
    the interleaved order is [x0, y0, x1, y1, ...]. Works for weights and biases.
    """
    rows = weight.shape[0]
    head_dim = rows // num_heads
    rest = weight.shape[1:]
    w = weight.reshape(num_heads, 2, head_dim // 2, *rest)
    return w.transpose(1, 2).reshape(rows, *rest).contiguous()


def interleave_norm_weight(weight: torch.Tensor) -> torch.Tensor:
    """The same permutation for a per-head (head_dim,) norm weight (Qwen3 q/k norm)."""
    return to_interleaved_rows(weight, 1)
