"""GGUF's K-quant, 5-bit and 8-bit block types decoded into unsigned codes and the file's scales.

The codes ``u`` and scales are exactly what the file stores, re-laid out (no second
rounding): :meth:`BlockCodes.dequantize` gives bit for bit the values of
``gguf.quants.dequantize``. Three scale modes, one per family::

    mode 3 (f16s) Q8_0  block 32: d f16 | 32 int8 q          u = q + 128, w = d (u - 128)
                  Q5_0  block 32: d | qh u32 | 16 B nibbles  u = 5-bit code, w = d (u - 16)
                  sub = fp16 d per block of 32
    mode 0 (f16)  Q5_1  block 32: d | m | qh | 16 B          w = d u + m
                  sub = fp16 (scale, min) per block of 32
    mode 1 (k32)  Q4_K  block 256: d | dmin | 12 B 6-bit (sc, mn) x 8 | 128 B nibbles
                  Q5_K  block 256: d | dmin | 12 B 6-bit (sc, mn) x 8 | 32 B qh | 128 B
                  w = (d sc_j) u - (dmin mn_j) per sub-block j of 32
                  sub = uint8 (sc, mn) per 32, sup = fp16 (d, dmin) per 256
    mode 2 (k16)  Q6_K  block 256: 128 B ql | 64 B qh | 16 int8 sc | d
                  w = (d sc_h) (u - 32) per 16;  sub = int8 (sc_0, sc_1) per 32, sup = fp16 d

Element order inside blocks follows llama.cpp's (ggml-quants.c), as ``gguf.quants`` reads it.
Q4_K becomes block codes only where the block kernel runs (``to_block_codes(..., q4_k=True)``);
elsewhere it is the int4 kernel's affine groups (:mod:`~llmserve.model.quant.gguf_blocks`).
The int8-activation kernel that multiplies these is :mod:`~llmserve.model.quant.native_qblock`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch
from gguf import GGMLQuantizationType

from llmserve.model.loading.gguf import RawGGUFTensor
from llmserve.model.quant.gguf_blocks import f16_at, k_scales, nibbles_32, raw_blocks

Q = GGMLQuantizationType
MODE_F16, MODE_K32, MODE_K16, MODE_F16S = 0, 1, 2, 3
BLOCK = 32
SUPER = 256


@dataclass
class BlockCodes:
    """Unsigned codes ``(N, K)`` uint8 of ``bits`` bits with their GGUF scales (see module
    docstring for ``mode``, ``sub`` ``(N, K/32, 1|2)`` and ``sup`` ``(N, K/256, 1|2)``)."""

    qtype: str
    codes: torch.Tensor
    bits: int
    mode: int           # MODE_F16 | MODE_K32 | MODE_K16 | MODE_F16S
    sub: torch.Tensor
    sup: Optional[torch.Tensor]

    def dequantize(self) -> torch.Tensor:
        """Float32 weights (N, K): the values gguf's dequantizer gives for the same blocks."""
        n, k = self.codes.shape
        u = self.codes.float().view(n, k // BLOCK, BLOCK)
        if self.mode == MODE_F16S:
            w = (u - float(1 << (self.bits - 1))) * self.sub.float()
        elif self.mode == MODE_F16:
            sub = self.sub.float()
            w = u * sub[..., :1] + sub[..., 1:]
        elif self.mode == MODE_K32:
            sup = self.sup.float().repeat_interleave(SUPER // BLOCK, dim=1)
            scale = sup[..., 0] * self.sub[..., 0].float()
            dmin = sup[..., 1] * self.sub[..., 1].float()
            w = u * scale.unsqueeze(-1) - dmin.unsqueeze(-1)
        else:
            d = self.sup[..., 0].float().repeat_interleave(SUPER // 16)
            scale = d.view(n, -1) * self.sub.reshape(n, -1).float()      # (N, K/16)
            w = (u.view(n, -1, 16) - 32.0) * scale.unsqueeze(-1)
        return w.reshape(n, k)

    @staticmethod
    def cat(parts: "list[BlockCodes]") -> "BlockCodes":
        """Stack shards of one GGUF type along the output rows."""
        kinds = {(p.qtype, p.bits, p.mode) for p in parts}
        if len(kinds) != 1:
            raise ValueError(f"cannot fuse block shards of types {sorted(k[0] for k in kinds)}")
        sup = None if parts[0].sup is None else torch.cat([p.sup for p in parts])
        return BlockCodes(parts[0].qtype, torch.cat([p.codes for p in parts]), parts[0].bits,
                          parts[0].mode, torch.cat([p.sub for p in parts]), sup)


def _high_bits_32(qh: np.ndarray) -> np.ndarray:
    """(..., 4) bytes (a little-endian u32) -> (..., 32) bits: bit i is element i's bit 4."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


def _q8_0(b: np.ndarray) -> tuple:
    u = (b[..., 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return u, f16_at(b, 0)[..., None], None


def _q5_0(b: np.ndarray) -> tuple:
    u = nibbles_32(b[..., 6:22]) | (_high_bits_32(b[..., 2:6]) << 4)
    return u, f16_at(b, 0)[..., None], None


def _q5_1(b: np.ndarray) -> tuple:
    u = nibbles_32(b[..., 8:24]) | (_high_bits_32(b[..., 4:8]) << 4)
    return u, np.stack([f16_at(b, 0), f16_at(b, 2)], axis=-1), None


def _k_scales_and_supers(b: np.ndarray) -> tuple:
    """A Q4_K/Q5_K block's uint8 (sc, mn) ``(..., 8, 2)`` and fp16 (d, dmin) ``(..., 2)``."""
    sc, mn = k_scales(b[..., 4:16])                       # (..., 8) each
    sub = np.stack([sc, mn], axis=-1).astype(np.uint8)
    return sub, np.stack([f16_at(b, 0), f16_at(b, 2)], axis=-1)


def _q4_k(b: np.ndarray) -> tuple:
    lead = b.shape[:-1]                                   # (rows, supers)
    qs = b[..., 16:144].reshape(*lead, 4, 1, 32) >> np.array([0, 4], np.uint8)[:, None]
    return ((qs & 0x0F).reshape(*lead, 8, 32), *_k_scales_and_supers(b))


def _q5_k(b: np.ndarray) -> tuple:
    lead = b.shape[:-1]
    qh = b[..., 16:48][..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]   # (..., 8, 32)
    qs = b[..., 48:176].reshape(*lead, 4, 1, 32) >> np.array([0, 4], np.uint8)[:, None]
    u = (qs & 0x0F).reshape(*lead, 8, 32) | ((qh & 1) << 4)
    return (u, *_k_scales_and_supers(b))


def _q6_k(b: np.ndarray) -> tuple:
    lead = b.shape[:-1]
    ql = b[..., 0:128].reshape(*lead, 2, 1, 64) >> np.array([0, 4], np.uint8)[:, None]
    qh = b[..., 128:192].reshape(*lead, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]
    u = (ql & 0x0F).reshape(*lead, 8, 32) | ((qh & 3).reshape(*lead, 8, 32) << 4)
    sub = b[..., 192:208].view(np.int8).reshape(*lead, 8, 2)
    return u, sub, f16_at(b, 208)[..., None]


#: type -> (block elements, block bytes, bits, mode, decoder)
_DECODERS: "dict[Q, tuple[int, int, int, int, Callable]]" = {
    Q.Q8_0: (32, 34, 8, MODE_F16S, _q8_0),
    Q.Q5_0: (32, 22, 5, MODE_F16S, _q5_0),
    Q.Q5_1: (32, 24, 5, MODE_F16, _q5_1),
    Q.Q4_K: (256, 144, 4, MODE_K32, _q4_k),
    Q.Q5_K: (256, 176, 5, MODE_K32, _q5_k),
    Q.Q6_K: (256, 210, 6, MODE_K16, _q6_k),
}
#: the types kept as block codes (Q4_K too where asked: ``to_block_codes(..., q4_k=True)``)
BLOCK_CODE_TYPES = frozenset(_DECODERS) - {Q.Q4_K}


def to_block_codes(raw: RawGGUFTensor, q4_k: bool = False) -> Optional[BlockCodes]:
    """The codes and scales of a Q8_0/Q5_0/Q5_1/Q5_K/Q6_K tensor (and Q4_K with ``q4_k``);
    None for other types and for non-finite fp16 scales (the product would be NaN; the
    caller keeps its float path)."""
    if raw.qtype not in BLOCK_CODE_TYPES and not (q4_k and raw.qtype == Q.Q4_K):
        return None
    block, size, bits, mode, decode = _DECODERS[raw.qtype]
    rows, cols = raw.shape
    u, sub, sup = decode(raw_blocks(raw, block, size))
    sub = sub.reshape(rows, cols // BLOCK, -1)
    scales = sub if mode in (MODE_F16, MODE_F16S) else sup
    if scales.dtype == np.float16 and not np.isfinite(scales.astype(np.float32)).all():
        return None
    return BlockCodes(
        raw.qtype.name, torch.from_numpy(np.ascontiguousarray(u.reshape(rows, cols))), bits,
        mode, torch.from_numpy(np.ascontiguousarray(sub)),
        None if sup is None else torch.from_numpy(np.ascontiguousarray(
            sup.reshape(rows, cols // SUPER, -1))))
