"""Decode attention by llmserve's native kernel (``model/native/csrc/paged_decode.cpp``).

The compiled in-place formulation (:func:`~llmserve.model.attention.paged.paged_decode_inplace`)
lets inductor index the cache, but its generated loops were slow: at 32 sequences they took
a large share of the default model's decode step. The native kernel does the same
arithmetic (float32 scores and sums, exact bf16 products) with one task a query row (every
head of the row; or a task per row and KV head when there are fewer rows than twice the
threads) that pulls the row's context into cache and reads each K and V row where it lives,
and is several times faster there (docs/ARCHITECTURE.md, "Native kernels"; figures in
docs/BENCHMARKS.md).

Each CPU tier's library has one (``llmserve_native::paged_decode`` on the AVX-512 tiers,
``llmserve_avx2::paged_decode`` on the avx2 tier: ``csrc/avx2/paged_decode_avx2.cpp``, the
same contract in 8-lane vectors, for bf16 or float32); :func:`native_decode_available` picks
the tier's, once, and float32 queries on the AVX-512 tiers take the avx2 library's, loaded
beside it (the AVX-512 kernel reads bf16 caches only). Used for decode rows and prompt rows
when the library is loaded and checked (``PagedBackend.native_decode``, decided once from the
model and KV dtypes): queries and a KV cache of one dtype it serves, on CPU, a head size that
is a multiple of 16. Quantized KV caches, other dtypes and other devices keep the
compiled/eager paths.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from llmserve.model.native.ops import kernel_checked, tier_ops

#: ``paged_decode`` of each query/cache dtype (filled by :func:`_decode_ops`)
_PAGED_DECODE: "dict[torch.dtype, Any]" = {}


def paged_decode_native(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        slots: torch.Tensor, valid: torch.Tensor, scale: float,
                        softcap: Optional[float] = None) -> torch.Tensor:
    """``q (B, H, D)`` against cached rows ``slots (B, L)`` where ``valid (B, L)`` ->
    ``(B, H * D)``: the contract of :func:`~llmserve.model.attention.paged.paged_decode_inplace`."""
    op = _PAGED_DECODE.get(q.dtype) or _decode_ops()[q.dtype]
    return op(q, k_cache, v_cache, slots, valid, scale, float(softcap or 0.0))


def _decode_ops() -> "dict[torch.dtype, Any]":
    """The ``paged_decode`` operator of each dtype, looked up once: the tier library's for
    bf16 (and float32 on the avx2 tier); float32 on the AVX-512 tiers is added by
    :func:`native_decode_serves` when a float32 model asks (the AVX-512 library's kernel
    reads bf16 caches only)."""
    from llmserve.model.native.ops import cpu_tier

    if not _PAGED_DECODE:
        ops = tier_ops()
        if ops is None:
            raise RuntimeError("paged_decode_native: no native library on this CPU tier")
        _PAGED_DECODE[torch.bfloat16] = ops.paged_decode
        if cpu_tier() == "avx2":
            _PAGED_DECODE[torch.float32] = ops.paged_decode
    return _PAGED_DECODE


def native_decode_serves(dtype: torch.dtype) -> bool:
    """A native ``paged_decode`` takes queries and a cache of ``dtype`` here (the library is
    loaded and the kernel passed its self-test). Float32 on the AVX-512 tiers loads the avx2
    library beside the AVX-512 one for its float32 kernel, on the first ask only, so a bf16
    model never builds or loads it (decided once per process and dtype)."""
    from llmserve.model.native.ops import avx2_library_loaded

    if not native_decode_available():
        return False
    if dtype in _decode_ops():
        return True
    if dtype != torch.float32 or not avx2_library_loaded():
        return False
    _PAGED_DECODE.setdefault(torch.float32, torch.ops.llmserve_avx2.paged_decode)
    if kernel_checked("paged_decode_float32", lambda: _self_test((torch.float32,)),
                      library=avx2_library_loaded):
        return True
    _PAGED_DECODE.pop(torch.float32, None)
    return False


def native_decode_dtypes() -> "tuple[torch.dtype, ...]":
    """The query / cache dtypes a native ``paged_decode`` takes here: bf16, and float32 where
    the avx2 library serves it (its own tier, or beside the AVX-512 library)."""
    return tuple(d for d in (torch.bfloat16, torch.float32) if native_decode_serves(d))


def _self_test(dtypes: "tuple[torch.dtype, ...] | None" = None) -> bool:
    """``paged_decode`` of each of ``dtypes`` (default: the tier library's own) against the
    PyTorch reference."""
    from llmserve.model.attention.paged import paged_decode_inplace

    gen = torch.Generator().manual_seed(0)
    for dtype in tuple(_decode_ops()) if dtypes is None else dtypes:
        kc = torch.randn(64, 2, 64, generator=gen).to(dtype)
        vc = torch.randn(64, 2, 64, generator=gen).to(dtype)
        q = torch.randn(3, 6, 64, generator=gen).to(dtype)
        slots = torch.randint(0, 64, (3, 20), generator=gen)
        valid = torch.arange(20).unsqueeze(0) < torch.tensor([[20], [7], [1]])
        ref = paged_decode_inplace(q, kc, vc, slots, valid, 0.125).float()
        got = paged_decode_native(q, kc, vc, slots, valid, 0.125).float()
        if not bool(((got - ref).abs() <= 0.01).all()):
            return False
    return True


def native_decode_available() -> bool:
    """This CPU tier's library is loaded and its decode attention checks out (once per
    process)."""
    return kernel_checked("paged_decode", _self_test, library=lambda: tier_ops() is not None)



def kv_store_native(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """``cache[slots] = x`` for bf16 rows ``x (T, Hkv, D)`` (heads contiguous) by the native
    row copies (``model/native/csrc/kv_store.cpp``): the bytes of ``index_copy_``."""
    torch.ops.llmserve_native.kv_store(cache, slots, x)


def _kv_store_self_test() -> bool:
    gen = torch.Generator().manual_seed(0)
    want = torch.randn(40, 2, 64, generator=gen).bfloat16()
    got = want.clone()
    qkv = torch.randn(9, 3 * 128, generator=gen).bfloat16()
    x = qkv[:, 128:256].view(9, 2, 64)                    # a strided view, as V is
    slots = torch.randperm(40, generator=gen)[:9]
    want.index_copy_(0, slots, x)
    kv_store_native(got, slots, x)
    return torch.equal(got, want)


def native_kv_store_available() -> bool:
    """The native library is loaded and its KV row copies check out (once per process)."""
    return kernel_checked("kv_store", _kv_store_self_test)
