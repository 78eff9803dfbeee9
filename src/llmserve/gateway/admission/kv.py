"""Live-KV admission: refuse new work while the engine's KV cache is nearly full.

The engine starts a waiting request as soon as its *prompt* fits in the free KV
blocks; its completion then grows one block at a time. Under a burst, many requests
start, grow together, run the pool dry and the scheduler preempts (frees and later
recomputes) running requests, again and again: a preemption storm, where every request
gets slower and the work done is thrown away.

:class:`KVAdmission` (one per engine) keeps a request out of the engine while the KV
cache is under pressure. Each admitted request *commits* the blocks it may need::

    need = ceil((prompt_tokens + num_choices * reserve) / block_size) + num_choices

(``reserve`` is max_tokens per choice, or ``max_tokens_reservation`` for a request
that did not set it; the extra block per sequence covers its partly filled last
block). The projected use is the larger of the engine's live count of blocks in use
(``get_stats().kv_blocks_used``) and the blocks committed by requests in flight. A new
request is refused with a retryable 503 ``kv_cache_pressure`` when

    projected + need > total_blocks - watermark_blocks      (watermark = kv_watermark * total)

unless no request is in flight (so any request that fits the pool can always run).
Its ``Retry-After`` is the blocks missing divided by the rate at which committed
blocks were released over the last minute, between 1 s and ``max_retry_after_s``.
A commitment is released when its request ends (:meth:`KVCommitment.release`).

Thread-safe; the clock is injectable. No torch here.
"""
from __future__ import annotations

import collections
import logging
import math
import threading
import time
from typing import Callable, Optional

from llmserve.contract.engine_client import EngineClient
from llmserve.gateway.errors import KVCachePressureError

logger = logging.getLogger(__name__)

#: Releases older than this are forgotten by the Retry-After estimate.
RELEASE_WINDOW_S = 60.0


def blocks_needed(prompt_tokens: int, num_choices: int, reserve_per_choice: int,
                  block_size: int) -> int:
    """KV blocks a request may need (see the module docstring)."""
    choices = max(1, num_choices)
    tokens = prompt_tokens + choices * max(0, reserve_per_choice)
    return -(-tokens // block_size) + choices


class KVCommitment:
    """The blocks one admitted request committed; ``release()`` once (later calls no-op)."""

    def __init__(self, owner: "KVAdmission", blocks: int) -> None:
        self._owner = owner
        self.blocks = blocks
        self.released = False

    def release(self) -> None:
        """Give the blocks back (the request ended)."""
        self._owner._release(self)


class KVAdmission:
    """Live-KV admission for one engine (see the module docstring).

    Args:
        engine: anything with ``get_stats()`` returning ``kv_blocks_used`` / ``kv_blocks_total``.
        watermark: share of the pool kept free, in [0, 1).
        max_retry_after_s: cap of the ``Retry-After`` estimate.
        clock: monotonic seconds.
    """

    def __init__(self, engine: EngineClient, watermark: float, max_retry_after_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not 0 <= watermark < 1:
            raise ValueError(f"watermark must be in [0, 1), got {watermark!r}")
        self.engine = engine
        self.watermark = float(watermark)
        self.max_retry_after_s = float(max_retry_after_s)
        self._clock = clock
        self._lock = threading.Lock()
        self._committed = 0
        self._in_flight = 0
        self._releases: collections.deque[tuple[float, int]] = collections.deque()

    def _live(self) -> tuple[int, int]:
        """(blocks in use, blocks in the pool) from the engine's stats."""
        stats = self.engine.get_stats()
        return int(stats.kv_blocks_used), int(stats.kv_blocks_total)

    def commit(self, blocks: int) -> KVCommitment:
        """Admit a request that may need ``blocks`` blocks, or raise KVCachePressureError."""
        used, total = self._live()
        limit = total - math.ceil(self.watermark * total)
        with self._lock:
            projected = max(used, self._committed)
            if self._in_flight and projected + blocks > limit:
                wait = self._estimate_wait(projected + blocks - limit)
                raise KVCachePressureError(
                    f"The server's KV cache is nearly full ({projected} of {total} blocks in use "
                    f"or committed; this request may need {blocks}); please retry later", wait)
            self._committed += blocks
            self._in_flight += 1
        return KVCommitment(self, blocks)

    def _release(self, commitment: KVCommitment) -> None:
        with self._lock:
            if commitment.released:
                return
            commitment.released = True
            self._committed -= commitment.blocks
            self._in_flight -= 1
            now = self._clock()
            self._releases.append((now, commitment.blocks))
            self._forget(now)

    def _forget(self, now: float) -> None:
        while self._releases and self._releases[0][0] < now - RELEASE_WINDOW_S:
            self._releases.popleft()

    def _estimate_wait(self, missing_blocks: int) -> float:
        """Seconds until ``missing_blocks`` are likely released (called with the lock held)."""
        now = self._clock()
        self._forget(now)
        released = sum(b for _, b in self._releases)
        if not released:
            return 1.0
        span = max(now - self._releases[0][0], 1.0)
        return min(self.max_retry_after_s, max(1.0, missing_blocks / (released / span)))

    @property
    def committed_blocks(self) -> int:
        """Blocks committed by the requests in flight."""
        with self._lock:
            return self._committed


def kv_admission_for(engine: EngineClient, watermark: Optional[float], max_retry_after_s: float
                     ) -> Optional[KVAdmission]:
    """A KVAdmission for ``engine``, or None when the gate is off (``watermark`` None)."""
    if watermark is None:
        return None
    return KVAdmission(engine, watermark, max_retry_after_s)
