"""KV-cache quantization: int8 or fp8 (e4m3) codes with one float32 scale per token and head.

A quantized cache keeps the pool's one-tensor-per-layer layout; each (slot, head) row holds
the head's ``D`` codes followed by the 4 bytes of its float32 scale::

    (num_slots, kv_heads, D + 4)  dtype int8 | float8_e4m3fn
    row: [ c_0 c_1 ... c_{D-1} | scale (float32 bytes) ]      x[d] = c_d * scale

so block gathers, the slot-indexed compiled decode and the scratch block work unchanged, and
the cache's dtype says how to read it. Codes are chosen per row: int8 with
``scale = max|x| / 127`` (round to nearest, error <= scale / 2), fp8 with
``scale = max|x| / 448`` (e4m3's largest finite value; 3 mantissa bits, relative error
<= 2^-4 per element). Bytes per token and head: ``D + 4`` instead of ``2 D`` (bf16).
"""
from __future__ import annotations

import torch

_SCALE_BYTES = 4
_CODE_MAX = {torch.int8: 127.0}
if hasattr(torch, "float8_e4m3fn"):
    _CODE_MAX[torch.float8_e4m3fn] = 448.0

#: ``--kv-cache-dtype`` names of the quantized caches.
KV_QUANT_DTYPES = {"int8": torch.int8}
if hasattr(torch, "float8_e4m3fn"):
    KV_QUANT_DTYPES["fp8_e4m3"] = torch.float8_e4m3fn


def is_quantized_kv(dtype: torch.dtype) -> bool:
    return dtype in _CODE_MAX


def kv_row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements in one (slot, head) row of the cache tensor."""
    return head_dim + _SCALE_BYTES if is_quantized_kv(dtype) else head_dim


def kv_bytes_per_head(head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one token's K (or V) of one head takes, scale included."""
    return kv_row_width(head_dim, dtype) * torch.empty((), dtype=dtype).element_size()


def quantize_kv(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x (..., D)`` -> cache rows ``(..., D + 4)`` of ``dtype`` (codes, then the scale)."""
    xf = x.float()
    scale = (xf.abs().amax(-1, keepdim=True) / _CODE_MAX[dtype]).clamp_min(1e-12)
    if dtype == torch.int8:
        codes = torch.round(xf / scale).clamp_(-127, 127).to(torch.int8)
    else:
        codes = (xf / scale).to(dtype)
    return torch.cat([codes.view(torch.uint8), scale.view(torch.uint8)], -1).view(dtype)


def dequantize_kv(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows ``(..., D + 4)`` -> values ``(..., D)`` of ``dtype``."""
    d = rows.shape[-1] - _SCALE_BYTES
    scale = rows[..., d:].contiguous().view(torch.float32)
    return (rows[..., :d].float() * scale).to(dtype)


def store_kv(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """Write ``x (T, H, D)`` into ``cache`` at ``slots``, quantizing if the cache is."""
    if is_quantized_kv(cache.dtype):
        # through byte views: index_copy_ has no float8 kernel on the CPU
        cache.view(torch.uint8).index_copy_(0, slots, quantize_kv(x, cache.dtype).view(torch.uint8))
    else:
        cache.index_copy_(0, slots, x.to(cache.dtype))


def load_kv(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows read from a cache (any leading shape) as values of ``dtype``."""
    if is_quantized_kv(rows.dtype):
        return dequantize_kv(rows, dtype)
    return rows.to(dtype)
