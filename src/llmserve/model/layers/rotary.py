"""Rotary position embeddings, with Llama-3, linear and LongRoPE (Phi-3) frequency scaling.

LongRoPE has two sets of per-frequency divisors: ``short_factor`` for contexts within the
pretraining length ``original_max_position_embeddings`` and ``long_factor`` beyond it, and
scales cos/sin by ``attention_factor`` (default ``sqrt(1 + ln(factor) / ln(original))``).
Transformers switches sets per forward call by the sequence's length, which would leave keys
cached under the other set; here the set is fixed per engine, like llama.cpp: long when the
engine's context (the table's positions) exceeds the pretraining length, short otherwise.

Q/K stay in Hugging Face's half-split layout (GGUF files are un-permuted to it at load), so
checkpoints load without any row permutation.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch
from torch import nn

from llmserve.model.layers.compiled_rows import WARMUP_ROWS, compile_rows, many_rows


def rope_inv_freq(head_dim: int, theta: float, scaling: Optional[dict],
                  context_len: Optional[int] = None) -> torch.Tensor:
    """Inverse frequencies (head_dim/2,), with "llama3" / "linear" / "longrope" scaling applied.

    ``context_len``: the longest context the engine serves (LongRoPE picks its factor set by it).
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in (None, "default"):
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind in ("longrope", "su"):
        original = int(scaling["original_max_position_embeddings"])
        use_long = context_len is not None and context_len > original
        factors = scaling["long_factor" if use_long else "short_factor"]
        if len(factors) != head_dim // 2:
            raise ValueError(f"longrope factors have {len(factors)} entries; head_dim "
                             f"{head_dim} needs {head_dim // 2}")
        return inv_freq / torch.tensor(factors, dtype=torch.float64)
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
    raise ValueError(f"unsupported rope scaling type {kind!r} "
                     "(supported: default, linear, llama3, longrope)")


def rope_attention_factor(scaling: Optional[dict]) -> float:
    """The factor cos and sin are multiplied by (LongRoPE's attention scaling; else 1)."""
    if not scaling or scaling.get("rope_type") not in ("longrope", "su"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = int(scaling["original_max_position_embeddings"])
    factor = float(scaling.get("factor") or 1.0)
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


class RotaryEmbedding(nn.Module):
    """Rotates q and k in Hugging Face's half-split layout with a precomputed cos/sin table.

    Per head, dims ``[0, d/2)`` and ``[d/2, d)`` form the rotating pairs ``(x_i, y_i)``::

        x' = x cos(p w_i) - y sin(p w_i)        y' = y cos(p w_i) + x sin(p w_i)

    The table is ``(max_positions, head_dim)`` float32: cos in the first half, sin in the
    second; one row lookup per token, real arithmetic only (compile-friendly). The runner
    builds one spare row (``max_model_len + 1``), so the served context is ``max_positions - 1``.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: Optional[dict], device: torch.device) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary head_dim must be even, got {head_dim}")
        inv_freq = rope_inv_freq(head_dim, theta, scaling, context_len=max_positions - 1)
        pos = torch.arange(max_positions, dtype=torch.float64)
        angles = torch.outer(pos, inv_freq)
        table = torch.cat([angles.cos(), angles.sin()], -1) * rope_attention_factor(scaling)
        table = table.to(torch.float32)
        self.register_buffer("cos_sin", table.to(device), persistent=False)
        self.rows_rotary: Optional[Callable[..., tuple[torch.Tensor, torch.Tensor]]] = None

    def compile_rows(self, dtype: torch.dtype, device: torch.device) -> bool:
        """Take the many-row rotation: llmserve's native kernel for bf16 CPU rows where it
        passed its self-test (the same bits as :func:`rotate_qk`, several times faster than
        the compiled function at prefill sizes), else the compiled function
        (layers/compiled_rows.py), built on q and k as the attention passes them: views of
        one fused projection row."""
        if dtype == torch.bfloat16 and torch.device(device).type == "cpu" and \
                native_rotate_qk_available():
            self.rows_rotary = native_rotate_qk
            return True
        rows, d = WARMUP_ROWS, self.cos_sin.shape[1]
        qkv = torch.zeros(rows, 7 * d, dtype=dtype, device=device)     # 3 + 2 + 2 heads
        q, k = qkv[:, :3 * d].view(rows, 3, d), qkv[:, 3 * d:5 * d].view(rows, 2, d)
        positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.rows_rotary = compile_rows(rotate_qk, self.cos_sin, positions, q, k)
        return self.rows_rotary is not None

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``q (T, Hq, D)``, ``k (T, Hkv, D)`` rotated to their positions ``(T,)``."""
        if self.rows_rotary is not None and many_rows(positions.shape[0]):
            return self.rows_rotary(self.cos_sin, positions, q, k)
        return rotate_qk(self.cos_sin, positions, q, k)


def rotate_qk(cos_sin: torch.Tensor, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``q`` and ``k`` rotated by the rows ``positions`` of a ``[cos | sin]`` table."""
    cs = cos_sin.index_select(0, positions).unsqueeze(1)      # (T, 1, D)
    half = cs.shape[-1] // 2
    cos, sin = cs[..., :half], cs[..., half:]
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def native_rotate_qk(cos_sin: torch.Tensor, positions: torch.Tensor, q: torch.Tensor,
                     k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rotate_qk` by llmserve's native kernel (``model/native/csrc/rotary.cpp``): bf16
    ``(T, H, D)`` views with contiguous heads, the same bits."""
    q_rot, k_rot = torch.ops.llmserve_native.rotate_qk(cos_sin, positions, q, k)
    return q_rot, k_rot


def _native_self_test() -> bool:
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(50, 64, generator=gen)
    qkv = (torch.randn(37, 7 * 64, generator=gen) * 4).bfloat16()
    q, k = qkv[:, :5 * 64].view(37, 5, 64), qkv[:, 5 * 64:].view(37, 2, 64)
    positions = torch.randint(0, 50, (37,), generator=gen)
    want, got = rotate_qk(table, positions, q, k), native_rotate_qk(table, positions, q, k)
    return torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])


def native_rotate_qk_available() -> bool:
    """The native library is loaded and ``rotate_qk`` gives :func:`rotate_qk`'s bits (once
    per process)."""
    from llmserve.model.native.ops import kernel_checked

    return kernel_checked("rotate_qk", _native_self_test)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)
