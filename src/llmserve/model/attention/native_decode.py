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

import logging
from typing import Any, Optional

import torch

from llmserve.model.native.ops import kernel_checked
from llmserve.model.quant.kv import KV_QUANT_DTYPES

logger = logging.getLogger(__name__)

#: the operator serving each (query, cache) dtype pair here, once its self-test passed
_PAGED_DECODE: "dict[tuple[torch.dtype, torch.dtype], Any]" = {}

#: the 8-bit KV cache dtypes a native kernel reads (codes and a float32 scale a row)
_CODE_DTYPES = tuple(KV_QUANT_DTYPES.values())


def paged_decode_native(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        slots: torch.Tensor, valid: torch.Tensor, scale: float,
                        softcap: Optional[float] = None) -> torch.Tensor:
    """``q (B, H, D)`` against cached rows ``slots (B, L)`` where ``valid (B, L)`` ->
    ``(B, H * D)``: the contract of :func:`~llmserve.model.attention.paged.paged_decode_inplace`.

    Raises:
        RuntimeError: no native kernel takes these query and cache dtypes here.
    """
    key = (q.dtype, k_cache.dtype)
    op = _PAGED_DECODE.get(key)
    if op is None:
        if not native_decode_serves(*key):
            raise RuntimeError(f"paged_decode_native: no native kernel for {key[0]} queries "
                               f"over a {key[1]} cache on this CPU tier")
        op = _PAGED_DECODE[key]
    return op(q, k_cache, v_cache, slots, valid, scale, float(softcap or 0.0))


def native_decode_kernel(dtype: torch.dtype,
                         kv_dtype: Optional[torch.dtype] = None) -> "tuple[str, str] | None":
    """``(library, operator)`` that would serve queries of ``dtype`` over a cache of
    ``kv_dtype`` (default ``dtype``) on this CPU tier, or None: on the avx2 tier its one
    ``paged_decode`` (bf16 or float32 queries over their own dtype or 8-bit codes); on the
    AVX-512 tiers ``paged_decode`` (bf16 caches) and ``paged_decode_q8`` (8-bit caches) under
    bf16 queries, and the avx2 library's kernel under float32 queries (loaded beside)."""
    from llmserve.model.native.ops import cpu_tier, tier_library

    key = (dtype, dtype if kv_dtype is None else kv_dtype)
    coded = key[1] in _CODE_DTYPES
    if key[0] not in (torch.bfloat16, torch.float32) or not (coded or key[1] == key[0]):
        return None
    library = tier_library()
    if library is None:
        return None
    if cpu_tier() == "avx2":
        return library, "paged_decode"
    if key[0] == torch.float32:
        return "llmserve_avx2", "paged_decode"
    return library, "paged_decode_q8" if coded else "paged_decode"


def native_decode_serves(dtype: torch.dtype, kv_dtype: Optional[torch.dtype] = None) -> bool:
    """A native kernel (:func:`native_decode_kernel`) takes queries of ``dtype`` over a cache
    of ``kv_dtype`` (default: ``dtype``) here: its library is loaded and the kernel passed
    its self-test for that pair, decided once per process and pair. The avx2 library is
    built and loaded beside the AVX-512 one on the first float32 ask only, so a bf16 model
    never builds or loads it."""
    from llmserve.model.native.ops import avx2_library_loaded, tier_library

    key = (dtype, dtype if kv_dtype is None else kv_dtype)
    if key in _PAGED_DECODE:
        return True
    kernel = native_decode_kernel(*key)
    if kernel is None:
        return False
    library, name = kernel
    loaded = avx2_library_loaded if library != tier_library() else lambda: True
    op: "list[Any]" = []

    def test() -> bool:   # a kernel that raises fails its test; the engine keeps PyTorch's
        op.append(getattr(getattr(torch.ops, library), name))
        try:
            return _self_test(key, op[0])
        except RuntimeError as e:
            logger.warning("native %s raised in its self-test: %s", name, e)
            return False

    if not kernel_checked(_check_name(key), test, library=loaded):
        return False
    _PAGED_DECODE[key] = op[0] if op else getattr(getattr(torch.ops, library), name)
    return True


def _check_name(key: "tuple[torch.dtype, torch.dtype]") -> str:
    """The self-test's name of a (query, cache) pair: ``paged_decode`` for bf16 over bf16,
    ``paged_decode_float32`` for float32 over float32, else ``paged_decode_<q>_over_<kv>``."""
    if key[0] == key[1]:
        return "paged_decode" if key[0] == torch.bfloat16 else "paged_decode_float32"
    q, kv = (str(d).removeprefix("torch.") for d in key)
    return f"paged_decode_{q}_over_{kv}"


def native_decode_dtypes() -> "tuple[torch.dtype, ...]":
    """The dtypes a native ``paged_decode`` takes for queries and a cache of the same dtype
    here: bf16, and float32 where the avx2 library serves it (its own tier, or beside the
    AVX-512 library)."""
    return tuple(d for d in (torch.bfloat16, torch.float32) if native_decode_serves(d))


def _self_test(key: "tuple[torch.dtype, torch.dtype]", op: Any) -> bool:
    """``op``, the kernel of a (query, cache) dtype pair, against the PyTorch reference: 3
    rows and more than twice the threads (a task per row and KV head, and a task a row), a
    fixed group (6 heads over 2) and one sized at run time (20 over 2)."""
    from llmserve.model.attention.paged import paged_decode_inplace
    from llmserve.model.quant.kv import is_quantized_kv, quantize_kv

    gen = torch.Generator().manual_seed(0)
    dtype, kv_dtype = key
    k, v = torch.randn(64, 2, 64, generator=gen), torch.randn(64, 2, 64, generator=gen)
    if is_quantized_kv(kv_dtype):
        kc, vc = quantize_kv(k, kv_dtype), quantize_kv(v, kv_dtype)
    else:
        kc, vc = k.to(kv_dtype), v.to(kv_dtype)
    many = 2 * torch.get_num_threads() + 8
    for rows, heads in ((3, 6), (many, 6), (3, 20)):
        q = torch.randn(rows, heads, 64, generator=gen).to(dtype)
        slots = torch.randint(0, 64, (rows, 20), generator=gen)
        valid = torch.arange(20).unsqueeze(0) < torch.randint(1, 21, (rows, 1), generator=gen)
        ref = paged_decode_inplace(q, kc, vc, slots, valid, 0.125).float()
        got = op(q, kc, vc, slots, valid, 0.125, 0.0).float()
        if not bool(((got - ref).abs() <= 0.01).all()):
            return False
    return True


def native_decode_available() -> bool:
    """This CPU tier's library is loaded and its decode attention over bf16 caches checks
    out (once per process)."""
    return native_decode_serves(torch.bfloat16)


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
