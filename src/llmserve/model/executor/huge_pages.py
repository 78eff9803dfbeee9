"""Transparent huge pages (2 MB) for the weights and the CPU KV pool, on Linux.

On 4 KB pages every 4 KB of weights or KV read is another TLB entry, and inside a virtual
machine a TLB miss walks two page tables. Decode streams all the weights once a step (one
row: the whole file at memory speed) and paged attention reads each sequence's blocks from
anywhere in the pool, so both pay it. Measured on a 2-core AMD EPYC VM (docs/BENCHMARKS.md,
"Huge pages"): one-row products read their weights at 1.1x the rate (Q6_K, Q8_0, int4),
and a cold paged-decode call ran 1.2x faster over a pool on huge pages, the same bits.

Two calls, both best-effort (a page that cannot be made huge stays as it was):

- :func:`advise_huge_pages` before a tensor's memory is first written (the KV pool, which
  commits lazily): ``madvise(MADV_HUGEPAGE)``, so its page faults map 2 MB at a time. (numpy,
  which allocates the pool, advises its own large arrays too by default; this does not
  depend on it);
- :func:`collapse_huge_pages` after the weights are loaded and packed:
  ``madvise(MADV_COLLAPSE)`` (Linux 6.1+) remaps every 2 MB-aligned range they cover into
  huge pages in place, the same addresses and bytes, so no tensor is moved or rebound. On
  the VM above this takes ~1.8 s a GB (each new huge page is the hypervisor's first touch).

Both do nothing where the kernel's THP setting is ``never`` or absent, off Linux, or with
``LLMSERVE_HUGE_PAGES=0``.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os
import sys
import time
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch

logger = logging.getLogger(__name__)

MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25
_THP = Path("/sys/kernel/mm/transparent_hugepage")


def thp_setting() -> str:
    """The kernel's transparent-huge-page mode (``always``, ``madvise`` or ``never``), or
    ``unavailable`` where there is none to read."""
    try:
        text = (_THP / "enabled").read_text()
    except OSError:
        return "unavailable"
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else "unavailable"


@functools.lru_cache(maxsize=1)
def _huge_page_size() -> int:
    try:
        return int((_THP / "hpage_pmd_size").read_text())
    except (OSError, ValueError):
        return 2 << 20


@functools.lru_cache(maxsize=1)
def libc_madvise() -> Optional[Callable[..., int]]:
    """libc's madvise (the GIL is released while it runs), or None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def huge_pages_enabled() -> bool:
    """Whether this process asks for huge pages: Linux, a THP mode other than ``never``, and
    ``LLMSERVE_HUGE_PAGES`` not ``0``."""
    if os.environ.get("LLMSERVE_HUGE_PAGES", "1").strip().lower() in ("0", "false", "off"):
        return False
    return libc_madvise() is not None and thp_setting() in ("always", "madvise")


def aligned_ranges(spans: Iterable[tuple[int, int]], size: int,
                   join_gaps: bool) -> list[tuple[int, int]]:
    """The ``size``-aligned address ranges inside ``spans`` ([start, end) byte addresses).
    Overlapping spans merge; with ``join_gaps`` so do spans less than ``size`` apart (small
    tensors a few bytes or pages apart share one huge page: collapsing the bytes between
    them, whoever owns them, changes nothing they hold)."""
    merged: list[list[int]] = []
    for lo, hi in sorted(s for s in spans if s[1] > s[0]):
        if merged and lo - merged[-1][1] < (size if join_gaps else 1):
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    out: list[tuple[int, int]] = []
    for lo, hi in merged:
        a, b = -(-lo // size) * size, hi // size * size
        if b > a:
            out.append((a, b))
    return out


def _spans(tensors: Iterable[torch.Tensor]) -> list[tuple[int, int]]:
    storages = [t.untyped_storage() for t in tensors if t.device.type == "cpu"]
    return [(s.data_ptr(), s.data_ptr() + s.nbytes()) for s in storages]


def advise_huge_pages(tensors: Iterable[torch.Tensor]) -> int:
    """Ask for huge pages on the tensors' 2 MB-aligned memory before it is first written;
    returns the bytes advised (0 where huge pages are off)."""
    if not huge_pages_enabled():
        return 0
    fn = libc_madvise()
    total = 0
    for a, b in aligned_ranges(_spans(tensors), _huge_page_size(), join_gaps=False):
        if fn is not None and fn(a, b - a, MADV_HUGEPAGE) == 0:
            total += b - a
    return total


def collapse_huge_pages(tensors: Iterable[torch.Tensor]) -> tuple[int, int]:
    """Remap the tensors' populated memory into huge pages in place, one 2 MB range at a
    time; returns (bytes now in huge pages, bytes tried). Contents and addresses do not
    change, so this is safe on any anonymous memory, shared or not."""
    if not huge_pages_enabled():
        return 0, 0
    fn = libc_madvise()
    size = _huge_page_size()
    done = tried = 0
    for a, b in aligned_ranges(_spans(tensors), size, join_gaps=True):
        for start in range(a, b, size):
            tried += size
            if fn is not None and fn(start, size, MADV_COLLAPSE) == 0:
                done += size
    return done, tried


def collapse_module(module: torch.nn.Module) -> int:
    """:func:`collapse_huge_pages` over a loaded model's parameters and buffers (CPU ones),
    logged; returns the bytes now in huge pages."""
    t0 = time.time()
    done, tried = collapse_huge_pages([*module.parameters(), *module.buffers()])
    if tried:
        logger.info("weights: %.0f MB of their memory in 2 MB pages (%.0f MB tried, %.2f s)",
                    done / 1e6, tried / 1e6, time.time() - t0)
    return done
