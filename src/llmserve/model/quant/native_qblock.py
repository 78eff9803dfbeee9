"""GGUF block weights on llmserve's int8-activation kernel (``qblock_a8_mm``).

:class:`QBlockWeight` holds a Q8_0, Q5_0, Q5_1, Q4_K, Q5_K or Q6_K matrix in the file's own
codes and scales (:mod:`~llmserve.model.quant.block_codes`), packed once for
``model/native/csrc/qblock_int8_gemm.cpp``, whose comment documents the layout: strips of 16
output channels, per block of 32 k's a nibble plane (as the int4 x int8 kernel's) plus one bit
plane per bit above 4 (8-bit codes: plain bytes). Resident bits per weight: Q8_0 8.5,
Q5_0 5.5, Q5_1 6, Q4_K 4.625 (file 4.5), Q5_K 5.625 (file 5.5), Q6_K 6.5625 (the file's):
within 3% of the file. :class:`QBlockTable` is such a weight used as a token table too (a
tied K-quant embedding: the lookup decodes the selected rows from the packed strips).

Activations are quantized by rows in blocks of 32, as for the int4 weights' default path, so
the kernel needs AVX512-VNNI (:func:`native_qblock_available`); where it is missing, or with
``--int4-activations bf16``, these types keep today's int8-per-channel path (a second
rounding). :class:`SplitWeight` runs a fused layer whose shards have different types (Q4_K
q/k with a Q6_K v) as one product per shard, each in its own format.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch
from torch import nn

from llmserve.model.loading.gguf import RawGGUFTensor
from llmserve.model.native.ops import a8_supported, cut_padding, kernel_checked
from llmserve.model.quant.block_codes import (
    MODE_F16,
    MODE_F16S,
    MODE_K16,
    MODE_K32,
    BlockCodes,
    to_block_codes,
)
from llmserve.model.quant.kernels import as_kernel_input
from llmserve.model.quant.native_int8 import quantized_rows_reference

STRIP = 16
BLOCK = 32


def _strips(t: torch.Tensor, n_pad: int) -> torch.Tensor:
    """(N, a, b) -> (N/16, a, b, 16) after padding N with zero rows."""
    if n_pad:
        t = torch.cat([t, t.new_zeros(n_pad, *t.shape[1:])])
    n = t.shape[0]
    return t.view(n // STRIP, STRIP, *t.shape[1:]).permute(0, 2, 3, 1).contiguous()


def _bit_plane(u: torch.Tensor, bit: int) -> torch.Tensor:
    """(S*16, K) codes -> (S, K/32, 64) bytes: per octet and nibble half, 8 bytes whose bit
    4c + j is ``bit`` of the code the kernel's nibble byte 4c + j holds."""
    n, k = u.shape
    bits = ((u >> bit) & 1).view(n // STRIP, STRIP, k // 8, 2, 4).permute(0, 2, 3, 1, 4)
    bits = bits.reshape(n // STRIP, k // 8, 2, 64).numpy()
    packed = np.packbits(bits, axis=-1, bitorder="little")      # (S, K/8, 2, 8)
    return torch.from_numpy(packed).view(n // STRIP, k // BLOCK, 64)


def _as_f16(sup: torch.Tensor) -> torch.Tensor:
    """Super-block scales as the file's fp16 (a float32 tensor must hold fp16 values)."""
    half = sup.half()
    if sup.dtype != torch.float16 and not torch.equal(half.to(sup.dtype), sup):
        raise ValueError("super-block scales must be float16 values (GGUF stores them so)")
    return half


def pack_qblock(codes: BlockCodes) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """``(packed uint8 (N/16, K/32 * 64 * bits), sub (N/16, K/32, 2, 16), sup)`` for the
    kernel; N is padded to 16 with zero rows (zero scales: their outputs are 0)."""
    u = codes.codes.to(torch.uint8)
    n, k = u.shape
    pad = -n % STRIP
    if pad:
        u = torch.cat([u, u.new_zeros(pad, k)])
    strips = u.shape[0] // STRIP
    if codes.bits == 8:
        packed = u.view(strips, STRIP, k // 4, 4).permute(0, 2, 1, 3).reshape(strips, k * STRIP)
    else:
        t = (u & 15).view(strips, STRIP, k // 8, 2, 4).permute(0, 2, 1, 4, 3)
        nib = (t[..., 0] | (t[..., 1] << 4)).reshape(strips, k // BLOCK, 256)
        planes = [_bit_plane(u, 4 + p) for p in range(codes.bits - 4)]
        packed = torch.cat([nib, *planes], -1).reshape(strips, -1)
    sub = _strips(codes.sub, pad)
    sup = None if codes.sup is None else _strips(_as_f16(codes.sup), pad)
    return packed.contiguous(), sub, sup


def qblock_a8_mm(x: torch.Tensor, packed: torch.Tensor, sub: torch.Tensor,
                 sup: Optional[torch.Tensor], bits: int, mode: int,
                 float_out: bool = False) -> torch.Tensor:
    """``x (M, K) bf16 @ W^T`` with ``x`` quantized to int8 by rows in blocks of 32
    -> (M, N padded to 16), bf16 or float32 (``float_out``)."""
    return torch.ops.llmserve_native.qblock_a8_mm(x, packed, sub, sup, bits, mode, float_out)


def qblock_reference(x: torch.Tensor, codes: BlockCodes) -> torch.Tensor:
    """The kernel's arithmetic in float64 (before its output rounding)."""
    return quantized_rows_reference(x) @ codes.dequantize().double().T


def _self_test() -> bool:
    """Each (bits, mode) against its float64 reference, and its rows read back as the
    codes dequantize, so a miscompiled kernel is never used."""
    gen = torch.Generator().manual_seed(0)
    x25 = torch.randn(25, 512, generator=gen).bfloat16()
    for bits, mode in ((8, MODE_F16S), (5, MODE_F16S), (5, MODE_F16), (4, MODE_K32),
                       (5, MODE_K32), (6, MODE_K16)):
        u = torch.randint(0, 1 << bits, (32, 512), generator=gen, dtype=torch.uint8)
        if mode == MODE_F16S:
            sub, sup = (torch.rand(32, 16, 1, generator=gen) * 0.01).half(), None
        elif mode == MODE_F16:
            sub = torch.stack([torch.rand(32, 16, generator=gen) * 0.01,
                               torch.rand(32, 16, generator=gen) - 0.5], -1).half()
            sup = None
        else:
            sub = torch.randint(-60 if mode == MODE_K16 else 0, 64, (32, 16, 2), generator=gen)
            sub = sub.to(torch.int8 if mode == MODE_K16 else torch.uint8)
            sup = (torch.rand(32, 2, 2 if mode == MODE_K32 else 1, generator=gen) * 0.001).half()
        codes = BlockCodes("test", u, bits, mode, sub, sup)
        packed = pack_qblock(codes)
        for x in (x25[:9], x25):     # row tiles over packed codes, and over a panel of bytes
            y = qblock_a8_mm(x, *packed, bits, mode, float_out=True).double()
            ref = qblock_reference(x, codes)
            if not bool(((y - ref).abs() <= 1e-4 * ref.abs() + 1e-3).all()):
                return False
        rows = torch.ops.llmserve_native.qblock_rows(torch.arange(32), *packed, bits, mode, 32)
        if not torch.equal(rows, codes.dequantize()):
            return False
    return True


def native_qblock_available() -> bool:
    """The native library is loaded, the CPU has AVX512-VNNI and every block kernel checks
    out against its reference (once per process)."""
    return kernel_checked("qblock_a8", _self_test, supported=a8_supported)


def _check_whole_blocks(codes: BlockCodes) -> None:
    """The kernel's unit along K: 32 for the per-block modes, a super-block of 256 else."""
    k = codes.codes.shape[1]
    if k % (BLOCK if codes.mode in (MODE_F16, MODE_F16S) else 256):
        raise ValueError(f"{codes.qtype} weight: K={k} does not fill whole blocks")


class QBlockWeight(nn.Module):
    """A GGUF block-quantized weight (N, K) and its product ``x (..., K) -> (..., N)`` by
    ``qblock_a8_mm`` (the caller checks :func:`native_qblock_available`)."""

    def __init__(self, codes: BlockCodes) -> None:
        super().__init__()
        if codes.mode not in (MODE_F16, MODE_F16S, MODE_K32, MODE_K16):
            raise ValueError(f"unknown block scale mode {codes.mode}")
        rows, k = codes.codes.shape
        _check_whole_blocks(codes)
        self._adopt(codes.qtype, codes.bits, codes.mode, rows, k, *pack_qblock(codes))

    def _adopt(self, qtype: str, bits: int, mode: int, rows: int, k: int,
               packed: torch.Tensor, sub: torch.Tensor, sup: Optional[torch.Tensor]) -> None:
        self.out_features, self.in_features = rows, k
        self.qtype, self.bits, self.mode = qtype, bits, mode
        self.register_buffer("qweight", packed, persistent=False)
        self.register_buffer("sub", sub, persistent=False)
        self.register_buffer("sup", sup, persistent=False)

    def _product(self, x: torch.Tensor, float_out: bool) -> torch.Tensor:
        y = qblock_a8_mm(as_kernel_input(x), self.qweight, self.sub, self.sup, self.bits,
                         self.mode, float_out)
        return cut_padding(y, self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._product(x, False)
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The product in float32 (an LM head: near-tied logits are not rounded to bf16)."""
        return self._product(x, True).reshape(*x.shape[:-1], self.out_features)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    @property
    def format_name(self) -> str:
        """``gguf-q6_k-a8``: the type kept, with int8 activations."""
        return f"gguf-{self.qtype.lower()}-a8"

    def extra_repr(self) -> str:
        return f"{self.qtype} x int8 activations, {self.out_features}x{self.in_features}"


class QBlockTable(QBlockWeight):
    """A block weight that is also a token table (a tied embedding kept in the file's
    K-quant or 5-bit blocks): :meth:`logits` is the LM head's product and :meth:`rows` the
    embedding lookup, which decodes the selected rows from the packed strips (gguf's own
    values: no second rounding; ``llmserve_native::qblock_rows``), so the table is held
    once, at the file's size."""

    #: the head's product always quantizes its activations (the block kernel's arithmetic)
    int8_activations = True

    @classmethod
    def from_raw(cls, raw: RawGGUFTensor, chunk_rows: int = 4096) -> "Optional[QBlockTable]":
        """The table of a GGUF tensor, decoded and packed ``chunk_rows`` rows at a time (whole
        strips: the temporaries stay small for a 150k-row vocabulary); None where its blocks
        cannot be kept (non-finite scales, or a type without a block mode)."""
        if chunk_rows % STRIP:
            raise ValueError(f"chunk_rows must be a multiple of {STRIP}, got {chunk_rows}")
        rows, k = raw.shape
        first: Optional[BlockCodes] = None
        packs = []
        for start in range(0, rows, chunk_rows):
            end = min(start + chunk_rows, rows)
            codes = to_block_codes(RawGGUFTensor(raw.name, raw.qtype, (end - start, k),
                                                 raw.data[start:end]), q4_k=True)
            if codes is None:
                return None
            if first is None:
                _check_whole_blocks(codes)
                first = codes
            packs.append(pack_qblock(codes))
        if first is None:
            raise ValueError(f"{raw.name}: an empty table")
        packed = torch.cat([p[0] for p in packs])
        sub = torch.cat([p[1] for p in packs])
        sup = None if first.sup is None else torch.cat([p[2] for p in packs])
        qtype, bits, mode = first.qtype, first.bits, first.mode
        table = cls.__new__(cls)
        nn.Module.__init__(table)
        table._adopt(qtype, bits, mode, rows, k, packed, sub, sup)
        return table

    def with_int8_activations(self) -> "QBlockTable":
        return self

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` of the table, dequantized to ``dtype`` (an embedding lookup)."""
        flat = ids.reshape(-1).long()
        rows = torch.ops.llmserve_native.qblock_rows(flat, self.qweight, self.sub, self.sup,
                                                     self.bits, self.mode, self.out_features)
        return rows.to(dtype).view(*ids.shape, self.in_features)


class SplitWeight(nn.Module):
    """A fused layer whose shards keep different formats: one product per part, the outputs
    side by side (a Q4_K_M file's q/k in Q4_K and v in Q6_K)."""

    def __init__(self, parts: "list[nn.Module]") -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.count = len(parts)
        self.out_features = sum(int(p.out_features) for p in parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # indexed, not iterated: iterating a ModuleList adds a guard saved graphs cannot keep
        return torch.cat([self.parts[i](x) for i in range(self.count)], dim=-1)

    @property
    def nbytes(self) -> int:
        return sum(int(self.parts[i].nbytes) for i in range(self.count))

    @property
    def format_name(self) -> str:
        """``split:int4-g32-a8+gguf-q6_k-a8``: each part's format, in output order."""
        return "split:" + "+".join(str(self.parts[i].format_name) for i in range(self.count))

    def extra_repr(self) -> str:
        return f"{self.count} parts, {self.out_features} outputs"
