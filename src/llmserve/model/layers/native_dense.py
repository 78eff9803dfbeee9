"""Dense weights on llmserve's native products: bf16 (``model/native/csrc/bf16_gemm.cpp``)
and float32 (``csrc/portable/f32_gemm.cpp``).

A decode step at batch 1 is a chain of matrix-vector products, so its time is the weight
bytes over the read bandwidth. oneDNN's prepacked bf16 linear (``cpu_kernels``) reached only
part of the streaming bandwidth here, and each call went through a Python-registered op.
The native kernel reads a strip of 16 output channels as (k, k+1) pairs by ``vdpbf16ps``,
gets much closer to the streaming bandwidth, and is a C++ op (no Python in the call). Side
by side on the default model's shapes it is much faster than oneDNN at 1 row, less so as
the rows grow, and about even at 512 rows (docs/BENCHMARKS.md); it serves every row count
so the weights are kept once.

Packed layout (per strip of 16 output channels, one 32-value vector per pair of k's)::

    word 2c + t of vector j:  w[16s + c][2j + t]                      (c < 16, t < 2)

N is padded to 16 with zero rows (the output is cut back); K must be even.

Float32 weights (a dense checkpoint where the CPU has no native bf16: the avx2 tier's
default, or ``--dtype float32``) take the tier library's ``f32_mm``: one fused multiply-add
a k, in k order, for every output, so a row's product is the same alone or in any batch
(PyTorch's float32 GEMM picks its kernel by the row count). Its layout is k-major strips::

    element 16k + c of strip s:  w[16s + c][k]

:func:`pack_native` and :func:`native_mm` take either dtype.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from llmserve.model.native.ops import cut_padding, kernel_checked, pair_strips, tier_ops

#: The tier library's ``f32_mm`` (set once by :func:`native_f32_available`)
_F32_MM: Optional[Any] = None


def pack_bf16(w: torch.Tensor) -> torch.Tensor:
    """bf16 ``(ceil(N/16), K*16)`` of a weight ``(N, K)`` (K even), zero rows padding N."""
    return pair_strips(w.to(torch.bfloat16))


def bf16_mm(x: torch.Tensor, packed: torch.Tensor, out_features: int,
            float_out: bool = False) -> torch.Tensor:
    """``x (..., K) @ W^T`` -> ``(..., out_features)`` for a packed weight: bf16, or the
    float32 sums themselves with ``float_out`` (an LM head's logits)."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.dtype != torch.bfloat16:
        x2 = x2.to(torch.bfloat16)
    y = torch.ops.llmserve_native.bf16_mm(x2.contiguous(), packed, float_out)
    return cut_padding(y, out_features).view(*x.shape[:-1], out_features)


def _self_test() -> bool:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(40, 64, generator=gen).bfloat16()
    packed = pack_bf16(w)
    ok = True
    for rows in (1, 9, 30):
        x = torch.randn(rows, 64, generator=gen).bfloat16()
        ref = x.float() @ w.float().T
        y = bf16_mm(x, packed, 40).float()
        ok = ok and bool(((y - ref).abs() <= 0.01 * ref.abs() + 0.02).all())
    return ok


def native_dense_available() -> bool:
    """The native library is loaded and its bf16 product checks out (once per process)."""
    return kernel_checked("bf16", _self_test)


def pack_f32(w: torch.Tensor) -> torch.Tensor:
    """float32 ``(ceil(N/16), K*16)`` k-major strips of a weight ``(N, K)``, zero rows
    padding N."""
    n, k = w.shape
    w = w.float()
    pad = -n % 16
    if pad:
        w = torch.cat([w, w.new_zeros(pad, k)])
    return w.reshape(-1, 16, k).transpose(1, 2).contiguous().view(-1, k * 16)


def f32_mm(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """``x (..., K) @ W^T`` in float32 for a :func:`pack_f32` weight -> ``(..., N)``."""
    if _F32_MM is None and not native_f32_available():
        raise RuntimeError("f32_mm needs the CPU tier's kernel library (native_f32_available)")
    x2 = x.reshape(-1, x.shape[-1])
    if x2.dtype != torch.float32:
        x2 = x2.float()
    y = _F32_MM(x2.contiguous(), packed)
    return cut_padding(y, out_features).view(*x.shape[:-1], out_features)


def _f32_self_test() -> bool:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(40, 67, generator=gen)
    packed = pack_f32(w)
    x = torch.randn(30, 67, generator=gen)
    y = f32_mm(x, packed, 40)
    ref = (x.double() @ w.double().T).float()
    if not torch.allclose(y, ref, rtol=1e-4, atol=1e-4):
        return False
    alone = torch.cat([f32_mm(x[i:i + 1], packed, 40) for i in range(len(x))])
    return torch.equal(alone, y)


def native_f32_available() -> bool:
    """The CPU tier's library is loaded and its ``f32_mm`` checks out (once per process)."""
    global _F32_MM
    ops = tier_ops()
    if ops is None:
        return False
    if _F32_MM is None:
        _F32_MM = ops.f32_mm
    return kernel_checked("f32", _f32_self_test, library=lambda: tier_ops() is not None)


def can_pack_native(weight: torch.Tensor) -> bool:
    """A CPU weight a native product takes: bf16 with an even K where the bf16 kernel runs,
    or float32 where the tier's library has ``f32_mm``."""
    if weight.device.type != "cpu" or weight.dim() != 2:
        return False
    if weight.dtype == torch.bfloat16:
        return weight.shape[1] % 2 == 0 and native_dense_available()
    return weight.dtype == torch.float32 and native_f32_available()


def pack_native(weight: torch.Tensor) -> torch.Tensor:
    """A :func:`can_pack_native` weight in its kernel's layout (bf16 pairs, float32 strips)."""
    return pack_f32(weight) if weight.dtype == torch.float32 else pack_bf16(weight)


def native_mm(x: torch.Tensor, packed: torch.Tensor, out_features: int,
              float_out: bool = False) -> torch.Tensor:
    """The product of ``x`` with a :func:`pack_native` weight: bf16 (float32 sums with
    ``float_out``) or float32."""
    if packed.dtype == torch.float32:
        return f32_mm(x, packed, out_features)
    return bf16_mm(x, packed, out_features, float_out)


def native_product_name(packed: torch.Tensor) -> str:
    """``bf16_mm`` or ``f32_mm``: the kernel a packed weight runs (the kernel plan)."""
    return "f32_mm" if packed.dtype == torch.float32 else "bf16_mm"
