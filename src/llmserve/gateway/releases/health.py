"""Canary health: per release, what its recent requests did, over a sliding window.

Each finished request of a release adds one sample: failed or not, its time to first
token and its time per output token; each shadow comparison adds an agreement value.
:meth:`ReleaseHealth.verdict` checks a release against its model's
:class:`~llmserve.gateway.releases.config.HealthThresholds` once the window holds
``min_requests`` samples (``min_shadow_samples`` for the agreement): the error rate,
the TTFT and TPOT p95 and the mean shadow agreement. The gateway calls it after every
canary request and rolls the canary back on the first reason it returns.

A request *failed* when it ended with a 5xx or an engine error, or when the release
could not hold it (400 ``context_length_exceeded``: its context or its max_tokens
default is too small); quota, auth and other client errors do not count. Thread-safe;
bounded memory (samples older than the window are dropped). No torch.
"""
from __future__ import annotations

import math
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any, Callable, Deque, Optional

from llmserve.gateway.releases.config import HealthThresholds

#: Error codes of a 4xx that count against the release that answered it.
RELEASE_FAULT_CODES = frozenset({"context_length_exceeded"})


def is_release_failure(status: Optional[int], code: Optional[str]) -> bool:
    """True when an answer counts as the release's failure (see the module docstring)."""
    if status is None:
        return False
    return status >= 500 or (code is not None and code in RELEASE_FAULT_CODES)


def p95(values: list[float]) -> Optional[float]:
    """The 95th percentile (nearest rank) of ``values``; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


@dataclass
class _Sample:
    at: float
    failed: bool
    ttft_s: Optional[float]
    tpot_s: Optional[float]


class ReleaseHealth:
    """Sliding-window statistics of every release (see the module docstring)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._samples: dict[str, Deque[_Sample]] = {}
        self._agreement: dict[str, Deque[tuple[float, float]]] = {}
        self.totals: Counter[tuple[str, str]] = Counter()   # (release, ok|error) -> count

    def record(self, release: str, failed: bool, ttft_s: Optional[float] = None,
               tpot_s: Optional[float] = None) -> None:
        """One finished request of ``release``."""
        with self._lock:
            self._samples.setdefault(release, deque()).append(
                _Sample(self._clock(), failed, ttft_s, tpot_s))
            self.totals[(release, "error" if failed else "ok")] += 1

    def record_agreement(self, release: str, agreement: float) -> None:
        """One shadow comparison of ``release`` (token agreement in [0, 1])."""
        with self._lock:
            self._agreement.setdefault(release, deque()).append((self._clock(), agreement))

    def _trim(self, release: str, window_s: float) -> None:
        cutoff = self._clock() - window_s
        samples = self._samples.get(release)
        while samples and samples[0].at < cutoff:
            samples.popleft()
        agreement = self._agreement.get(release)
        while agreement and agreement[0][0] < cutoff:
            agreement.popleft()

    def _window(self, release: str, window_s: float) -> tuple[list[_Sample], list[float]]:
        """The window's samples and shadow agreements (copies, taken under the lock)."""
        with self._lock:
            self._trim(release, window_s)
            return (list(self._samples.get(release, ())),
                    [a for _, a in self._agreement.get(release, ())])

    def stats(self, release: str, window_s: float) -> dict[str, Any]:
        """The window's request count, error rate, TTFT/TPOT p95 and shadow agreement."""
        samples, agreement = self._window(release, window_s)
        n = len(samples)
        return {
            "requests": n,
            "error_rate": sum(s.failed for s in samples) / n if n else None,
            "ttft_p95_s": p95([s.ttft_s for s in samples if s.ttft_s is not None]),
            "tpot_p95_s": p95([s.tpot_s for s in samples if s.tpot_s is not None]),
            "shadow_comparisons": len(agreement),
            "shadow_agreement": sum(agreement) / len(agreement) if agreement else None,
        }

    def verdict(self, release: str, limits: HealthThresholds) -> Optional[str]:
        """The first threshold ``release`` crosses (``error_rate``, ``ttft_p95``,
        ``tpot_p95``, ``shadow_agreement``), or None while it is healthy or has too
        few samples. Runs after every canary request: only the configured thresholds are
        computed (a p95 sorts the window)."""
        samples, agreement = self._window(release, limits.window_s)
        n = len(samples)
        if n >= limits.min_requests:
            if (limits.max_error_rate is not None
                    and sum(s.failed for s in samples) / n > limits.max_error_rate):
                return "error_rate"
            for name, limit, attr in (("ttft_p95", limits.max_ttft_p95_s, "ttft_s"),
                                      ("tpot_p95", limits.max_tpot_p95_s, "tpot_s")):
                if limit is None:
                    continue
                value = p95([v for v in (getattr(s, attr) for s in samples) if v is not None])
                if value is not None and value > limit:
                    return name
        if (limits.min_shadow_agreement is not None
                and len(agreement) >= limits.min_shadow_samples
                and sum(agreement) / len(agreement) < limits.min_shadow_agreement):
            return "shadow_agreement"
        return None

    def reset(self, release: str) -> None:
        """Forget a release's window (after a rollback or a promotion)."""
        with self._lock:
            self._samples.pop(release, None)
            self._agreement.pop(release, None)
