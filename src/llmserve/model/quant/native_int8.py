"""Int8 weights for llmserve's native int8 x bf16 kernel (``model/native/csrc/int8_bf16_gemm.cpp``).

The default model's LM head (its tied int8 embedding table, 49152 x 576) is the largest
product of a decode step. PyTorch has no bf16-activation int8 GEMM: ``_weight_int8pack_mm``
costs about one weight pass per row, and from a few rows on the weights were converted to
bf16 tiles for oneDNN (a 56 MB write and read per step). The native kernel converts each
strip of 16 channels once into a per-thread bf16 buffer that stays in L1 and dots it with
tiles of 8 activation rows by ``vdpbf16ps``; ``y = scale * (x . q)`` in float32.

Packed layout (per strip of 16 output channels, one 32-byte vector per pair of k's)::

    byte 2c + t of vector j:  q[16s + c][2j + t]                      (c < 16, t < 2)

the same bytes as the row-major table, reordered; embedding lookups read rows back from it
(:func:`packed_rows`), so no second copy is kept.
"""
from __future__ import annotations

import torch

from llmserve.model.native.ops import a8_ops, cut_padding, kernel_checked, pair_strips

STRIP = 16
A8_BLOCK = 32     # activation quantization block of the int8-activation kernels


def pack_int8(q: torch.Tensor) -> torch.Tensor:
    """int8 ``(ceil(N/16), K*16)`` of codes ``q (N, K)`` (K even; zero rows pad N)."""
    return pair_strips(q)


def packed_rows(packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of the codes ``(len(ids), K)`` int8 read back from either packed layout:
    the pair layout (int8) or the quad layout of :func:`pack_int8_a8` (uint8, offset by 128)."""
    strips, width = packed.shape
    k = width // STRIP
    ids = ids.reshape(-1)
    if packed.dtype == torch.uint8:
        view = packed.view(strips, k // 4, STRIP, 4)
        rows = view[ids // STRIP, :, ids % STRIP, :].reshape(ids.shape[0], k)
        return (rows ^ 0x80).view(torch.int8)          # (q + 128) mod 256 -> q
    view = packed.view(strips, k // 2, STRIP, 2)
    return view[ids // STRIP, :, ids % STRIP, :].reshape(ids.shape[0], k)


def int8_mm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
            float_out: bool = False, out_features: "int | None" = None) -> torch.Tensor:
    """``x (M, K) bf16 @ (q * scale)^T`` -> ``(M, out_features)`` (default: N padded to 16),
    bf16 or float32."""
    y = torch.ops.llmserve_native.int8_mm(x, packed, scale, float_out)
    return y if out_features is None else cut_padding(y, out_features)


def _self_test() -> bool:
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(-127, 128, (48, 64), generator=gen, dtype=torch.int8)
    scale = (torch.rand(48, generator=gen) * 0.01).bfloat16()
    x = torch.randn(11, 64, generator=gen).bfloat16()
    ref = x.float() @ (q.float() * scale.float()[:, None]).T
    y = int8_mm(x, pack_int8(q), scale).float()
    ok = bool(((y - ref).abs() <= 0.01 * ref.abs() + 0.02).all())
    return ok and torch.equal(packed_rows(pack_int8(q), torch.tensor([0, 17, 47])),
                              q[[0, 17, 47]])


def native_int8_available() -> bool:
    """The native library is loaded and its int8 product checks out (once per process)."""
    return kernel_checked("int8", _self_test)


# ---- int8 activations: llmserve_native::int8_a8_mm (model/native/csrc/int8_int8_gemm.cpp) ----------
#
# Activation rows quantized in blocks of 32 (as int4_a8_mm's) meet the int8 codes in vpdpbusd,
# exact int32 sums; ``y = scale * sum_b s_b * dot_b`` in float32. vpdpbusd multiplies unsigned
# by signed bytes, so the codes are stored offset by 128 (the kernel subtracts 128 * sum of the
# activation codes per block). Quad layout per strip of 16 output channels::
#
#     byte 4c + j of quad o:  q[16s + c][4o + j] + 128                  (c < 16, j < 4)
#
# the same bytes as the table, reordered: embedding lookups read rows back (packed_rows).


def pack_int8_a8(q: torch.Tensor) -> torch.Tensor:
    """uint8 ``(ceil(N/16), K*16)`` of codes ``q (N, K)`` int8 (K a multiple of 32; zero
    codes pad N)."""
    n, k = q.shape
    if k % A8_BLOCK:
        raise ValueError(f"the int8 x int8 layout needs K % {A8_BLOCK} == 0, got K={k}")
    pad = -n % STRIP
    if pad:
        q = torch.cat([q, q.new_zeros(pad, k)])
    strips = (n + pad) // STRIP
    u = q.contiguous().view(torch.uint8) ^ 0x80                      # q + 128, as unsigned
    return u.view(strips, STRIP, k // 4, 4).permute(0, 2, 1, 3).contiguous().view(strips, k * STRIP)


def int8_a8_mm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
               float_out: bool = False, out_features: "int | None" = None) -> torch.Tensor:
    """``x (M, K) bf16 @ (q * scale)^T`` with ``x`` quantized to int8 by rows in blocks of 32
    -> ``(M, out_features)`` (default: N padded to 16), bf16 or float32. The tier's kernel
    (:func:`a8_ops`): AVX512-VNNI or AVX2."""
    y = a8_ops().int8_a8_mm(x, packed, scale, float_out)
    return y if out_features is None else cut_padding(y, out_features)


def quantized_rows_reference(x: torch.Tensor) -> torch.Tensor:
    """``x (M, K)`` as the int8-activation kernels see it, in float64: each block of 32
    quantized to ``round(x / s) * s``, ``s = max|x| / 127`` (float32 steps, as the kernels)."""
    m, k = x.shape
    xf = x.double().view(m, k // A8_BLOCK, A8_BLOCK)
    amax = xf.abs().amax(-1, keepdim=True)
    # float32 operations, each correctly rounded as the kernel's (float64, then rounded)
    inv = torch.where(amax > 1e-30, 127.0 / amax, torch.zeros_like(amax)).float().double()
    codes = torch.round((xf * inv).float()).double()
    return (codes * (amax / 127).float().double()).view(m, k)


def int8_a8_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The kernel's arithmetic in float64 (before its output rounding)."""
    return quantized_rows_reference(x) @ (q.double() * scale.double()[:, None]).T


def _self_test_a8() -> bool:
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(-128, 128, (40, 96), generator=gen, dtype=torch.int8)
    scale = (torch.rand(40, generator=gen) * 0.01).bfloat16()
    x = torch.randn(11, 96, generator=gen).bfloat16()
    packed = pack_int8_a8(q)
    padded = torch.cat([scale, scale.new_zeros(packed.shape[0] * STRIP - 40)])
    y = int8_a8_mm(x, packed, padded, True, 40).double()
    ref = int8_a8_reference(x, q, scale)
    ok = bool(((y - ref).abs() <= 1e-4 * ref.abs() + 1e-4).all())
    return ok and torch.equal(packed_rows(packed, torch.tensor([0, 17, 39])), q[[0, 17, 39]])


def native_int8_a8_available() -> bool:
    """The CPU tier has an int8 x int8 kernel (AVX512-VNNI, or the avx2 library) and it
    checks out (once per process)."""
    return kernel_checked("int8_a8", _self_test_a8, library=lambda: a8_ops() is not None)
