"""Whether drafts pay for their verify rows at the current batch size (no torch).

A decode step of ``R`` rows (one per sequence plus its drafts) takes ``cost(R)`` seconds.
At a small batch the step is bound by reading the weights and extra rows are nearly free;
at a large one it is bound by compute and every rejected draft costs throughput. Rather
than a fixed batch size above which nobody speculates, :class:`StepCostModel` measures
the engine's own decode steps (moving averages per row count) and
:func:`plan_drafts` gives drafts to the requests most likely to have them accepted while
the step's expected tokens per second still grow::

    (B + sum of expected accepted drafts) / cost(B + sum of drafts)  >  B / cost(B)

(by at least ``MIN_GAIN``, each request's drafts in turn).

``cost`` between measured row counts is interpolated, outside them extrapolated from the
two nearest (never a falling cost, never below a quarter of the nearest); with no measurement at all every draft is allowed, so
the first speculative steps measure what they cost. Every ``explore_every`` steps the plan
is skipped (drafts as planned by acceptance alone), so a row count that looked too
expensive once is measured again.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Optional, Sequence

_WEIGHT = 0.25        # weight of the newest step time in a row count's moving average
MIN_GAIN = 0.01       # drafts must raise the expected tokens per second by at least 1%


class StepCostModel:
    """Moving averages of decode-step seconds by row count."""

    def __init__(self, explore_every: int = 16) -> None:
        self.explore_every = explore_every
        self._rows: list[int] = []          # measured row counts, sorted
        self._seconds: dict[int, float] = {}

    @property
    def num_measured(self) -> int:
        """Distinct row counts measured."""
        return len(self._rows)

    def record(self, rows: int, seconds: float) -> None:
        """A decode step of ``rows`` rows took ``seconds``."""
        if rows <= 0 or seconds <= 0:
            return
        old = self._seconds.get(rows)
        if old is None:
            bisect.insort(self._rows, rows)
            self._seconds[rows] = seconds
        else:
            self._seconds[rows] = (1 - _WEIGHT) * old + _WEIGHT * seconds

    def cost(self, rows: int) -> Optional[float]:
        """Estimated seconds of a ``rows``-row step; None before any measurement."""
        known = self._rows
        if not known:
            return None
        if rows in self._seconds:
            return self._seconds[rows]
        if len(known) == 1:
            return self._seconds[known[0]]
        i = bisect.bisect_left(known, rows)
        if 0 < i < len(known):
            lo, hi = known[i - 1], known[i]
        elif i == 0:
            lo, hi = known[0], known[1]
        else:
            lo, hi = known[-2], known[-1]
        c_lo, c_hi = self._seconds[lo], self._seconds[hi]
        slope = max(0.0, (c_hi - c_lo) / (hi - lo))
        if rows > hi:
            return c_hi + slope * (rows - hi)
        return max(0.25 * c_lo, c_lo + slope * (rows - lo))

    def explores(self, step: int) -> bool:
        """Whether this step skips the plan (to measure again)."""
        return self.explore_every > 0 and step % self.explore_every == 0


@dataclass
class DraftCandidate:
    """A request that could speculate: ``k`` drafts at most, ``acceptance`` the expected
    fraction of its drafts accepted."""

    k: int
    acceptance: float


def plan_drafts(model: StepCostModel, base_rows: int, candidates: Sequence[DraftCandidate]
                ) -> list[int]:
    """Drafts for each candidate (0: none) so that the step's expected tokens per second
    grow with each one given; ``base_rows``: the step's rows without drafts. Greedy, most
    likely accepted first; a candidate whose full ``k`` does not pay is tried at half and
    at one draft."""
    ks = [0] * len(candidates)
    base = model.cost(base_rows)
    if base is None:
        return [c.k for c in candidates]
    tokens, rows, seconds = float(base_rows), base_rows, base
    order = sorted(range(len(candidates)), key=lambda i: -candidates[i].acceptance)
    for i in order:
        cand = candidates[i]
        for k in dict.fromkeys((cand.k, (cand.k + 1) // 2, 1)):
            if k <= 0:
                continue
            cost = model.cost(rows + k)
            gained = tokens + cand.acceptance * k
            if cost is not None and gained * seconds > (1 + MIN_GAIN) * tokens * cost:
                ks[i] = k
                tokens, rows, seconds = gained, rows + k, cost
                break
    return ks


def expected_accepted(acceptance: float, drafts: int) -> float:
    """Expected accepted drafts of ``drafts`` when each is accepted with probability
    ``acceptance`` given the ones before it (a prefix is accepted)."""
    a = min(max(acceptance, 0.0), 1.0)
    return float(drafts) if a >= 1.0 else a * (1 - a ** drafts) / (1 - a)


def uniform_draft_length(model: StepCostModel, lengths: Sequence[int],
                         acceptances: Sequence[float]) -> int:
    """One draft length ``L`` for every sequence of a decode step (each verifies ``L + 1``
    rows: longer drafts cut, shorter ones padded), the one whose expected tokens per
    second are highest; 0 (no drafts) unless drafts raise them by ``MIN_GAIN``. Uniform
    rows let the step run as one compiled verify graph instead of an eager step."""
    seqs = len(lengths)
    longest = max(lengths, default=0)
    base = model.cost(seqs)
    if base is None or longest == 0:
        return longest
    best, best_rate = 0, 0.0
    for length in range(1, longest + 1):
        cost = model.cost(seqs * (length + 1))
        tokens = seqs + sum(expected_accepted(a, min(n, length))
                            for n, a in zip(lengths, acceptances))
        if cost is not None and tokens / cost > best_rate:
            best, best_rate = length, tokens / cost
    return best if best_rate > (1 + MIN_GAIN) * seqs / base else 0
