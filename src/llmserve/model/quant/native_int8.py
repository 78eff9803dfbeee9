"""Int8 weights for llmserve's native int8 x bf16 kernel (``model/csrc/int8_bf16_gemm.cpp``).

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

from llmserve.model.native import cut_padding, kernel_checked, pair_strips

STRIP = 16


def pack_int8(q: torch.Tensor) -> torch.Tensor:
    """int8 ``(ceil(N/16), K*16)`` of codes ``q (N, K)`` (K even; zero rows pad N)."""
    return pair_strips(q)


def packed_rows(packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of the codes ``(len(ids), K)`` read back from the packed layout."""
    strips, width = packed.shape
    k = width // STRIP
    ids = ids.reshape(-1)
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
