"""Decode GGUF block-quantized rows into the kernels' formats without a dense detour.

The 4-bit families map exactly onto the int4 kernel's affine groups of 32
(``w = (q - 8) * scale + zero``), up to rounding ``scale`` and ``zero`` to bf16::

    Q4_0  block 32:  d f16 | 16 B nibbles        w = (q - 8) d       -> scale d,  zero 0
    Q4_1  block 32:  d f16 | m f16 | 16 B        w = q d + m         -> scale d,  zero m + 8d
    Q4_K  block 256: d f16 | dmin f16 | 12 B of 6-bit (sc, mn) x 8 | 128 B nibbles
                     8 sub-blocks of 32:  w = d sc_j q - dmin mn_j
                                                                     -> scale d sc_j,
                                                                        zero 8 d sc_j - dmin mn_j

Nibble order: Q4_0/Q4_1 keep elements 0..15 in the low nibbles of the 16 bytes and 16..31 in
the high ones; Q4_K stores 64 elements per 32 bytes, low nibbles first (sub-block 2c), then
high (sub-block 2c + 1). Every other type (Q8_0, Q5_*, Q6_K, Q2_K, Q3_K, IQ*) is decoded to
float32 by ``gguf.quants.dequantize`` and requantized by the linear method that receives it.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch
from gguf import GGMLQuantizationType

from llmserve.model.loading.gguf import RawGGUFTensor
from llmserve.model.quant.kernels import Int4Groups

Q = GGMLQuantizationType
#: Types that become int4 groups of 32 exactly (up to bf16 scales).
INT4_EXACT_TYPES = frozenset({Q.Q4_0, Q.Q4_1, Q.Q4_K})
_CHUNK_ROWS = 4096   # rows decoded at a time: bounds the float32 temporaries


def f16_at(blocks: np.ndarray, start: int) -> np.ndarray:
    """Little-endian float16 at byte ``start`` of each block, as float16 (..., nblocks)."""
    return np.ascontiguousarray(blocks[..., start:start + 2]).view(np.float16)[..., 0]


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    return f16_at(blocks, start).astype(np.float32)


def nibbles_32(qs: np.ndarray) -> np.ndarray:
    """(..., 16) bytes -> (..., 32) codes: low nibbles are elements 0..15, high 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def raw_blocks(raw: RawGGUFTensor, block: int, size: int) -> np.ndarray:
    """The tensor's bytes as ``(rows, blocks per row, size)`` for blocks of ``block``
    elements and ``size`` bytes.

    Raises:
        ValueError: the bytes do not hold the tensor's shape in that type.
    """
    rows, cols = raw.shape
    if cols % block or raw.data.shape != (rows, cols // block * size):
        raise ValueError(f"GGUF tensor {raw.name}: {raw.data.shape} bytes do not hold "
                         f"{rows}x{cols} {raw.qtype.name} weights")
    return raw.data.reshape(rows, cols // block, size)


def _q4_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _f16(blocks, 0)
    return nibbles_32(blocks[..., 2:18]), d, np.zeros_like(d)


def _q4_1(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    return nibbles_32(blocks[..., 4:20]), d, m + 8.0 * d


def k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """12 bytes of packed 6-bit values -> (scales, mins), each (..., 8)."""
    s = s.astype(np.uint8)
    lo_sc, lo_mn = s[..., 0:4] & 63, s[..., 4:8] & 63
    hi_sc = (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)
    hi_mn = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return (np.concatenate([lo_sc, hi_sc], -1).astype(np.float32),
            np.concatenate([lo_mn, hi_mn], -1).astype(np.float32))


def _q4_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d, dmin = _f16(blocks, 0)[..., None], _f16(blocks, 2)[..., None]
    sc, mn = k_scales(blocks[..., 4:16])
    qs = blocks[..., 16:144].reshape(*blocks.shape[:-1], 4, 32)
    codes = np.stack([qs & 0x0F, qs >> 4], axis=-2)                # (..., 4, 2, 32)
    codes = codes.reshape(*blocks.shape[:-1], 8, 32)
    scale = d * sc
    zero = 8.0 * scale - dmin * mn
    lead = blocks.shape[:-2]
    return (codes.reshape(*lead, -1, 32), scale.reshape(*lead, -1), zero.reshape(*lead, -1))


_DECODERS = {Q.Q4_0: (32, 18, _q4_0), Q.Q4_1: (32, 20, _q4_1), Q.Q4_K: (256, 144, _q4_k)}


def to_int4_groups(raw: RawGGUFTensor) -> Optional[Int4Groups]:
    """Exact int4 groups of 32 for Q4_0/Q4_1/Q4_K tensors; None for any other type."""
    if raw.qtype not in _DECODERS:
        return None
    block, size, decode = _DECODERS[raw.qtype]
    rows, cols = raw.shape
    codes, scale, zero = decode(raw_blocks(raw, block, size))
    return Int4Groups(q=torch.from_numpy(np.ascontiguousarray(codes.reshape(rows, cols))),
                      scale=torch.from_numpy(np.ascontiguousarray(scale.reshape(rows, -1))),
                      zero=torch.from_numpy(np.ascontiguousarray(zero.reshape(rows, -1))),
                      group_size=32)


def dequantize_raw(raw: RawGGUFTensor) -> torch.Tensor:
    """Float32 (rows, cols) weights of any GGUF type ``gguf.quants`` can decode."""
    out = torch.empty(raw.shape, dtype=torch.float32)
    for start in range(0, raw.shape[0], _CHUNK_ROWS):
        end = min(start + _CHUNK_ROWS, raw.shape[0])
        out[start:end] = torch.from_numpy(raw.dequantize(start, end))
    return out
