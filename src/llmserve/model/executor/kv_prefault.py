"""Committing the CPU KV pool's memory while the engine is idle.

The pool's tensors are committed lazily (kv_cache.py): a block's pages appear when the
first K/V row is written into them, inside a step. On the virtual machines measured here a
fresh 4 KB page costs ~9 us (the hypervisor backs it on first touch), so a block of the
default model (30 layers, K and V: 60 rows of 6 KB) costs ~0.8 ms the first time it is
written, and a burst of 64 new sequences that grows the pool past what was committed at
start spent ~3 ms of each 31 ms decode step in page faults (docs/BENCHMARKS.md).

A :class:`KVPrefaulter` commits the blocks the pool will hand out next (the block pool's
reserve is handed out in increasing order: engine/kv/block_pool.py) from a thread of its
own, a chunk of blocks at a time, and only while no step has run for ``idle_s``: it never
competes with a step for the two cores, and a burst that outruns it faults its pages in as
before. It uses ``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14+), which maps the pages
writable without changing their contents, so it is safe beside steps writing into the same
pages; where the call is unavailable the prefaulter stops at its first chunk.
"""
from __future__ import annotations

import ctypes
import logging
import threading
import time
from typing import Callable, Optional, Sequence

import torch

from llmserve.model.executor.huge_pages import libc_madvise as _madvise

logger = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23
_PAGE = 4096


def populate(tensors: Sequence[torch.Tensor], first_block: int, end_block: int,
             block_bytes: int) -> bool:
    """Commit blocks ``[first_block, end_block)`` of each tensor (rows of ``block_bytes``
    bytes per block, contiguous) without changing any byte; False where the kernel cannot
    (the caller stops trying)."""
    fn = _madvise()
    if fn is None or end_block <= first_block:
        return fn is not None
    for t in tensors:
        start = t.data_ptr() + first_block * block_bytes
        end = min(t.data_ptr() + end_block * block_bytes, t.data_ptr() + t.nbytes)
        lo, hi = start - start % _PAGE, -(-end // _PAGE) * _PAGE
        if fn(lo, hi - lo, MADV_POPULATE_WRITE) != 0:
            logger.info("KV prefault stopped: madvise(MADV_POPULATE_WRITE) failed (errno %d)",
                        ctypes.get_errno())
            return False
    return True


class KVPrefaulter:
    """Commits blocks ``[start, target)`` of a CPU KV pool in the background, ``chunk``
    blocks at a time, whenever ``last_step_end()`` is at least ``idle_s`` ago and no step
    runs (``busy()``). :meth:`stop` ends it; :attr:`committed` is the frontier reached."""

    def __init__(self, tensors: Sequence[torch.Tensor], block_bytes: int, start: int,
                 target: int, busy: Callable[[], bool], last_step_end: Callable[[], float],
                 chunk: int = 16, idle_s: float = 0.05) -> None:
        if block_bytes <= 0 or chunk < 1:
            raise ValueError(f"block_bytes and chunk must be positive, got {block_bytes}, {chunk}")
        self.tensors = list(tensors)
        self.block_bytes = block_bytes
        self.committed = start
        self.target = target
        self.chunk = chunk
        self.idle_s = idle_s
        self._busy, self._last_step_end = busy, last_step_end
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="llmserve-kv-prefault",
                                        daemon=True)

    def start(self) -> "KVPrefaulter":
        if self.committed < self.target:
            self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def done(self) -> bool:
        return self.committed >= self.target

    def _idle(self) -> bool:
        return not self._busy() and time.monotonic() - self._last_step_end() >= self.idle_s

    def _run(self) -> None:
        t0, first = time.perf_counter(), self.committed
        try:
            while not self._stop.is_set() and self.committed < self.target:
                if not self._idle():
                    self._stop.wait(self.idle_s)
                    continue
                end = min(self.target, self.committed + self.chunk)
                if not populate(self.tensors, self.committed, end, self.block_bytes):
                    return
                self.committed = end
            if self.committed >= self.target and self.committed > first:
                logger.info("KV pool: blocks %d-%d committed in the background (%.1f s)",
                            first, self.committed - 1, time.perf_counter() - t0)
        finally:
            self.tensors = []   # the pool's tensors are not kept alive by a finished thread


#: Tokens per sequence of the default prefault target (max_num_seqs x this)
PREFAULT_TOKENS_PER_SEQ = 256
#: The default target's cap in bytes of KV
PREFAULT_MAX_BYTES = 1 << 30


def prefault_target(setting: Optional[int], max_num_seqs: int, block_size: int,
                    bytes_per_block: int, committed: int, num_blocks: int) -> int:
    """The block the background commit stops before: ``setting`` tokens past the blocks
    committed at start, or by default ``max_num_seqs`` x 256 tokens in all (at most 1 GiB
    of KV); never past the pool."""
    if setting is None:
        tokens = max_num_seqs * PREFAULT_TOKENS_PER_SEQ
        blocks = min(-(-tokens // block_size), PREFAULT_MAX_BYTES // max(1, bytes_per_block))
        return min(num_blocks, max(committed, blocks))
    return min(num_blocks, committed + -(-setting // block_size))


def start_kv_prefault(caches: Sequence[tuple[torch.Tensor, ...]], block_size: int,
                      committed: int, num_blocks: int, setting: Optional[int],
                      max_num_seqs: int, busy: Callable[[], bool],
                      last_step_end: Callable[[], float]) -> Optional[KVPrefaulter]:
    """A started :class:`KVPrefaulter` for a CPU pool's layer ``caches`` (each (K, V)
    contiguous, rows of slots), or None when there is nothing to commit."""
    tensors = [t for pair in caches for t in pair]
    if not tensors or tensors[0].device.type != "cpu" or _madvise() is None:
        return None
    block_bytes = tensors[0].stride(0) * tensors[0].element_size() * block_size
    target = prefault_target(setting, max_num_seqs, block_size, block_bytes * len(tensors),
                             committed, num_blocks)
    if target <= committed:
        return None
    return KVPrefaulter(tensors, block_bytes, committed, target, busy, last_step_end).start()
