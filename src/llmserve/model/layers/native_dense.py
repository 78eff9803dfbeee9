"""Dense bf16 weights for llmserve's native bf16 kernel (``model/native/csrc/bf16_gemm.cpp``).

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
"""
from __future__ import annotations

import torch

from llmserve.model.native.ops import cut_padding, kernel_checked, pair_strips


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


def can_pack_native(weight: torch.Tensor) -> bool:
    """A bf16 CPU weight with an even K, on a machine with the native kernel."""
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16
            and weight.dim() == 2 and weight.shape[1] % 2 == 0 and native_dense_available())
