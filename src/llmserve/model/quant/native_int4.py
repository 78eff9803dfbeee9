"""Int4 weights for llmserve's native int4 x bf16 kernel (``model/native/csrc/int4_bf16_gemm.cpp``).

PyTorch's ``_weight_int4pack_mm_for_cpu`` dequantizes to float32 and multiplies 4 rows at a
time with float32 FMAs: its throughput stays flat whatever the batch, which left 8..32
sequence decode steps compute-bound. The native kernel dots the 4-bit codes (``q - 8``, exact
in bf16) with the bf16 activations by ``vdpbf16ps`` (exact products, float32 sums), shares
each dequantized vector among 8 activation rows, and applies a group's scale and zero once
per group: ``y += scale * dot + zero * sum(x over the group)``. Measured side by side on the
default model's shapes (AVX512-BF16), it beats the aten kernel at every row count tried and
bf16 tiles + oneDNN up to a few hundred rows, so it serves every row count
(docs/BENCHMARKS.md).

Packed layout (per strip of 16 output channels, one 32-byte chunk per 4 k's)::

    byte 2c + t of chunk j:  low nibble  q[16s + c][4j + t]          (c < 16, t < 2)
                             high nibble q[16s + c][4j + 2 + t]
    scales_zeros: (strips, K / g, 2, 16) bf16;   w = (q - 8) * scale + zero

Zero-extending a chunk's 32 bytes to words and looking the nibbles up gives two vectors of
16 (k, k+1) bf16 pairs: the operand layout of ``vdpbf16ps`` against a broadcast pair
``(x[k], x[k+1])``. 0.5 byte per weight plus 4 bytes per group, as PyTorch's layout.
"""
from __future__ import annotations

import torch

from llmserve.model.native.ops import a8_ops, kernel_checked
from llmserve.model.quant.native_int8 import A8_BLOCK, quantized_rows_reference

STRIP = 16


def pack_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
              group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(packed uint8 (N/16, K*8), scales_zeros bf16 (N/16, K/g, 2, 16))`` of codes ``q``
    (N, K) in 0..15 and float scales/zeros (N, K/g); N a multiple of 16, K of ``group_size``
    (itself a multiple of 8)."""
    n, k = q.shape
    if n % STRIP or k % group_size or group_size % 8:
        raise ValueError(f"native int4 packing needs N % 16 == 0 and K % group == 0 "
                         f"(group a multiple of 8), got N={n}, K={k}, group={group_size}")
    strips, groups = n // STRIP, k // group_size
    t = q.to(torch.uint8).view(strips, STRIP, k // 4, 2, 2).permute(0, 2, 1, 4, 3)
    packed = (t[..., 0] | (t[..., 1] << 4)).contiguous().view(strips, k // 4 * 32)
    sz = torch.stack([scale, zero]).to(torch.bfloat16).view(2, strips, STRIP, groups)
    return packed, sz.permute(1, 3, 0, 2).contiguous()


def int4_mm(x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor,
            group_size: int) -> torch.Tensor:
    """``x (M, K) bf16 @ W^T`` -> (M, N padded to 16) bf16."""
    return torch.ops.llmserve_native.int4_mm(x, packed, scales_zeros, group_size)


def _self_test() -> bool:
    """One small product against its float reference, so a miscompiled kernel is never used."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (32, 64), generator=gen, dtype=torch.uint8)
    scale = (torch.rand(32, 2, generator=gen) * 0.1).bfloat16().float()
    zero = (torch.rand(32, 2, generator=gen) - 0.5).bfloat16().float()
    x = torch.randn(9, 64, generator=gen).bfloat16()
    w = ((q.float() - 8).view(32, 2, 32) * scale[..., None] + zero[..., None]).view(32, 64)
    y = int4_mm(x, *pack_int4(q, scale, zero, 32), 32).float()
    ref = x.float() @ w.T
    return bool(((y - ref).abs() <= 0.01 * ref.abs() + 0.02).all())


def native_int4_available() -> bool:
    """The native library is loaded and its int4 product checks out (once per process)."""
    return kernel_checked("int4", _self_test)


# ---- int8 activations: llmserve_native::int4_a8_mm (model/native/csrc/int4_int8_gemm.cpp) ----------
#
# Each activation row is quantized in blocks of 32 (s = max|x| / 127, codes round(x / s)) and
# dotted with the 4-bit codes exactly in int32 by vpdpbusd: llama.cpp's Q4_1 x Q8_1
# arithmetic, above the bf16 kernel's throughput from 8 rows on (docs/BENCHMARKS.md). Layout
# per strip of 16 output channels, one 64-byte octet per 8 k's::
#
#     byte 4c + j of octet o:  low nibble  q[16s + c][8o + j]          (c < 16, j < 4)
#                              high nibble q[16s + c][8o + 4 + j]
#     scales_mins: (strips, K / g, 2, 16) fp16;   w = q * scale + min   (min = zero - 8 scale)
#
# 0.5 byte per weight plus 4 bytes per group, as the bf16 kernel's layout.



def _scales_mins(scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """fp16 ``(2, N, K/g)``: the scales and the mins ``zero - 8 * scale`` (w = q*scale + min)."""
    scale32 = scale.float()
    return torch.stack([scale32, zero.float() - 8 * scale32]).to(torch.float16)


def pack_int4_a8(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                 group_size: int) -> "tuple[torch.Tensor, torch.Tensor] | None":
    """``(packed uint8 (N/16, K*8), scales_mins fp16 (N/16, K/g, 2, 16))`` of codes ``q``
    (N, K) in 0..15 and float scales/zeros (N, K/g); N a multiple of 16, the group a multiple
    of 32. None when a scale or min does not fit fp16, or a scale would be subnormal there
    (the caller keeps bf16 activations)."""
    n, k = q.shape
    if n % STRIP or k % group_size or group_size % A8_BLOCK:
        raise ValueError(f"int4 x int8 packing needs N % 16 == 0 and K % group == 0 (group a "
                         f"multiple of 32), got N={n}, K={k}, group={group_size}")
    strips, groups = n // STRIP, k // group_size
    t = q.to(torch.uint8).view(strips, STRIP, k // 8, 2, 4).permute(0, 2, 1, 4, 3)
    packed = (t[..., 0] | (t[..., 1] << 4)).contiguous().view(strips, k // 8 * 64)
    tiny = (scale != 0) & (scale.float().abs() < 2.0 ** -14)   # subnormal (or 0) in fp16
    sm = _scales_mins(scale, zero)
    if not bool(torch.isfinite(sm).all()) or bool(tiny.any()):
        return None
    return packed, sm.view(2, strips, STRIP, groups).permute(1, 3, 0, 2).contiguous()


def int4_a8_mm(x: torch.Tensor, packed: torch.Tensor, scales_mins: torch.Tensor,
               group_size: int) -> torch.Tensor:
    """``x (M, K) bf16 @ W^T`` with ``x`` quantized to int8 by rows in blocks of 32
    -> (M, N padded to 16) bf16. The tier's kernel (:func:`a8_ops`): AVX512-VNNI or AVX2."""
    return a8_ops().int4_a8_mm(x, packed, scales_mins, group_size)


def int4_a8_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                      zero: torch.Tensor, group_size: int) -> torch.Tensor:
    """The kernel's arithmetic in float64 (before its bf16 output rounding): the rows of
    ``x`` quantized as the kernel does, times the weight with fp16 scale and min."""
    k = x.shape[1]
    xd = quantized_rows_reference(x)
    n = q.shape[0]
    sc, mn = _scales_mins(scale, zero).double()
    w = q.double().view(n, k // group_size, group_size) * sc[..., None] + mn[..., None]
    return xd @ w.view(n, k).T


def _self_test_a8() -> bool:
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (32, 128), generator=gen, dtype=torch.uint8)
    scale = torch.rand(32, 4, generator=gen) * 0.1 + 0.01
    zero = torch.rand(32, 4, generator=gen) - 0.5
    x = torch.randn(9, 128, generator=gen).bfloat16()
    packed = pack_int4_a8(q, scale, zero, 32)
    if packed is None:
        return False
    y = int4_a8_mm(x, *packed, 32).double()
    ref = int4_a8_reference(x, q, scale, zero, 32)
    return bool(((y - ref).abs() <= 0.01 * ref.abs() + 0.02).all())


def native_int4_a8_available() -> bool:
    """The CPU tier has an int4 x int8 kernel (AVX512-VNNI, or the avx2 library) and it
    checks out (once per process)."""
    return kernel_checked("int4_a8", _self_test_a8, library=lambda: a8_ops() is not None)
