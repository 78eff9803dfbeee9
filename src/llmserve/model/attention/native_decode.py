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
same contract in 8-lane vectors, for bf16, float32 or 8-bit caches). An 8-bit cache (int8
or fp8 e4m3 codes and a float32 scale a row, :mod:`llmserve.model.quant.kv`) is read in
place too: by ``llmserve_native::paged_decode_q8`` under bf16 queries on the AVX-512 tiers,
by the avx2 library's kernel under float32 queries or on the avx2 tier.
:func:`native_decode_serves` picks the kernel of a (query, cache) dtype pair once; the avx2
library is loaded beside the AVX-512 one only when a pair needs it. Used for decode rows and
prompt rows when the library is loaded and checked (``PagedBackend.native_decode``, decided
once from the model and KV dtypes), on CPU, for head sizes that are a multiple of 16. Other
dtypes and other devices keep the compiled/eager paths.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from llmserve.model.native.ops import kernel_checked, tier_ops

#: ``paged_decode`` of each (query, cache) dtype pair (filled by :func:`_decode_ops` and
#: :func:`native_decode_serves`)
_PAGED_DECODE: "dict[tuple[torch.dtype, torch.dtype], Any]" = {}

#: the 8-bit KV cache dtypes a native kernel reads (codes and a float32 scale a row,
#: :mod:`llmserve.model.quant.kv`)
_CODE_DTYPES = tuple(d for d in (torch.int8, getattr(torch, "float8_e4m3fn", None)) if d)

#: (query, cache) dtype pairs the avx2 library's ``paged_decode`` serves beyond the tier
#: library's own, loaded on the first ask: float32 caches on the AVX-512 tiers, and 8-bit
#: caches under float32 queries
_AVX2_PAIRS = ((torch.float32, torch.float32),
               *((torch.float32, code) for code in _CODE_DTYPES))


def paged_decode_native(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        slots: torch.Tensor, valid: torch.Tensor, scale: float,
                        softcap: Optional[float] = None) -> torch.Tensor:
    """``q (B, H, D)`` against cached rows ``slots (B, L)`` where ``valid (B, L)`` ->
    ``(B, H * D)``: the contract of :func:`~llmserve.model.attention.paged.paged_decode_inplace`."""
    key = (q.dtype, k_cache.dtype)
    op = _PAGED_DECODE.get(key) or _decode_ops()[key]
    return op(q, k_cache, v_cache, slots, valid, scale, float(softcap or 0.0))


def _decode_ops() -> "dict[tuple[torch.dtype, torch.dtype], Any]":
    """The ``paged_decode`` operator of each (query, cache) dtype pair, looked up once: the
    tier library's for bf16 queries over bf16 or 8-bit (int8, fp8 e4m3) caches
    (``paged_decode`` and ``paged_decode_q8`` on the AVX-512 tiers; on the avx2 tier its one
    ``paged_decode``, float32 too); the avx2 library's other pairs are added by
    :func:`native_decode_serves` when a model asks."""
    from llmserve.model.native.ops import cpu_tier

    if not _PAGED_DECODE:
        ops = tier_ops()
        if ops is None:
            raise RuntimeError("paged_decode_native: no native library on this CPU tier")
        _PAGED_DECODE[(torch.bfloat16, torch.bfloat16)] = ops.paged_decode
        avx2 = cpu_tier() == "avx2"   # its one kernel reads bf16, float32 and 8-bit caches
        if avx2:
            _PAGED_DECODE[(torch.float32, torch.float32)] = ops.paged_decode
        for code in _CODE_DTYPES:
            _PAGED_DECODE[(torch.bfloat16, code)] = \
                ops.paged_decode if avx2 else ops.paged_decode_q8
    return _PAGED_DECODE


def native_decode_serves(dtype: torch.dtype, kv_dtype: Optional[torch.dtype] = None) -> bool:
    """A native ``paged_decode`` takes queries of ``dtype`` over a cache of ``kv_dtype``
    (default: ``dtype``) here: the library is loaded and the kernel passed its self-test.
    Float32 caches on the AVX-512 tiers and 8-bit caches under float32 queries take the avx2
    library's kernel, loaded beside the tier's own on the first ask only, so a bf16 model with a bf16
    cache never builds or loads it (decided once per process and pair)."""
    from llmserve.model.native.ops import avx2_library_loaded

    key = (dtype, dtype if kv_dtype is None else kv_dtype)
    if not native_decode_available():
        return False
    if key in _decode_ops():
        return True
    if key not in _AVX2_PAIRS or not avx2_library_loaded():
        return False
    _PAGED_DECODE.setdefault(key, torch.ops.llmserve_avx2.paged_decode)
    name = "paged_decode_float32" if key[1] == torch.float32 else \
        f"paged_decode_float32_over_{str(key[1]).removeprefix('torch.')}"
    if kernel_checked(name, lambda: _self_test((key,)), library=avx2_library_loaded):
        return True
    _PAGED_DECODE.pop(key, None)
    return False


def native_decode_dtypes() -> "tuple[torch.dtype, ...]":
    """The dtypes a native ``paged_decode`` takes for queries and a cache of the same dtype
    here: bf16, and float32 where the avx2 library serves it (its own tier, or beside the
    AVX-512 library)."""
    return tuple(d for d in (torch.bfloat16, torch.float32) if native_decode_serves(d))


def _self_test(pairs: "tuple[tuple[torch.dtype, torch.dtype], ...] | None" = None) -> bool:
    """``paged_decode`` of each (query, cache) dtype pair of ``pairs`` (default: the tier
    library's own) against the PyTorch reference."""
    from llmserve.model.attention.paged import paged_decode_inplace
    from llmserve.model.quant.kv import is_quantized_kv, quantize_kv

    gen = torch.Generator().manual_seed(0)
    for dtype, kv_dtype in tuple(_decode_ops()) if pairs is None else pairs:
        k, v = torch.randn(64, 2, 64, generator=gen), torch.randn(64, 2, 64, generator=gen)
        if is_quantized_kv(kv_dtype):
            kc, vc = quantize_kv(k, kv_dtype), quantize_kv(v, kv_dtype)
        else:
            kc, vc = k.to(kv_dtype), v.to(kv_dtype)
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
