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
import logging
from dataclasses import dataclass
from typing import Optional, Sequence

logger = logging.getLogger(__name__)

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
        else:   # a step stalled by something else (a collection, the OS) counts as 2x
            self._seconds[rows] = (1 - _WEIGHT) * old + _WEIGHT * min(seconds, 2 * old)

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


class DraftYield:
    """What drafted decode steps actually yielded, per batch size: the check on the plan.

    The plan (:func:`plan_drafts`, :func:`uniform_draft_length`) predicts each step's tokens
    from the requests' acceptance averages, which lag and favour whoever was lucky last
    (measured on random text at 8 streams: predicted 1.07-1.17x the plain step's tokens per
    second, realized 0.96-0.99x). This keeps, per batch size ``B`` from 2 sequences, the
    realized gain of the decode steps with the engine's own drafts: their tokens per second
    against ``B / cost(B)`` of a plain step (moving averages of both sides, so a long step
    weighs more than a short one). Once it falls below ``1 + BATCH_GAIN``, ``B`` is closed:
    steps of ``B`` sequences (and of unmeasured sizes nearest to it) verify no drafts of the
    engine's own. A closed size opens again when the evidence reaches ``1 + REOPEN_GAIN``
    (a wider margin than closing, so drafting does not flap):

    * from shadow drafts (:mod:`~llmserve.spec_decode.shadow_drafts`, proposers whose
      drafts are cheap): the mean of at least ``SHADOW_SAMPLES`` estimates (a moving
      average once there are 16), times ``shadow_trust``, which opens every smaller size
      with it. ``shadow_trust`` (at most 1) is what the drafted steps after the last
      shadow reopening realized over what the shadows estimated: shadows run ahead of
      the drafted steps they lead to (on random text at 8 streams by about a third), so
      a reopening that does not pay makes the next one need that much more. A shadow step's
      tokens are counted, its time is not: it is priced with what a draft row cost
      the drafted steps of that size, relative to a plain step (``B + r * drafts`` plain
      rows for ``r`` the measured ratio), not with the cost model's seconds for its row
      count, which go stale (or were extrapolated from one slow step) while nothing
      drafts; or
    * from retries (other proposers): a drafted step after ``retry_after`` steps, the wait
      doubling with each retry granted (up to ``max_retry_after``), its realized gain
      added to the size's average.
    """

    def __init__(self, retry_after: int = 8, max_retry_after: int = 128) -> None:
        if not 1 <= retry_after <= max_retry_after:
            raise ValueError(f"need 1 <= retry_after <= max_retry_after, got {retry_after}, "
                             f"{max_retry_after}")
        self.retry_after = retry_after
        self.max_retry_after = max_retry_after
        self._real: dict[int, _Ratio] = {}
        self._row_cost: dict[int, _Ratio] = {}   # a draft row's time over a plain row's
        self._closed: set[int] = set()
        self._shadow: dict[int, _Ratio] = {}
        # what a size reopened by shadows then realized over what its shadows estimated
        # (at most 1), the last such verdict; shadow estimates are scaled by it
        self.shadow_trust = 1.0
        self._promised: dict[int, float] = {}   # size reopened by shadows -> their estimate
        self._wait: dict[int, int] = {}
        self._retry_at: dict[int, int] = {}

    @staticmethod
    def _nearest(table: dict[int, "_Ratio"], seqs: int) -> Optional[int]:
        """The size in ``table`` nearest ``seqs`` (the smaller of two as near): a batch
        passing through a size it has not drafted at yet (requests ending one by one) does
        not draft to learn what its neighbours already showed."""
        return min(table, key=lambda b: (abs(b - seqs), b)) if table else None

    def gain(self, seqs: int) -> Optional[float]:
        """The realized gain of drafted steps of ``seqs`` sequences, or of the nearest size
        measured; None before any drafted step of two sequences or more."""
        near = self._nearest(self._real, seqs)
        return None if near is None or not self._real[near].samples else self._real[near].value

    def is_open(self, seqs: int) -> bool:
        """Whether steps of ``seqs`` sequences may verify the engine's drafts (as far as
        this check goes). Always for one sequence: its step is bound by reading the
        weights, and whether its drafts pay is its own request's acceptance, which the
        request's average already follows (a gate there only slowed copying after a
        stretch of new text)."""
        if seqs < 2:
            return True
        near = self._nearest(self._real, seqs)
        return near is None or near not in self._closed

    def record(self, seqs: int, tokens: int, seconds: float, plain_seconds: float,
               rows: int = 0) -> None:
        """A decode step of ``seqs`` sequences with the engine's drafts (``rows`` rows in
        all) gave ``tokens`` tokens in ``seconds``; a plain step of as many sequences
        takes ``plain_seconds``."""
        if seqs < 2 or seconds <= 0 or plain_seconds <= 0:
            return
        real = self._real.setdefault(seqs, _Ratio(_WEIGHT))
        real.add(tokens, seqs * seconds / plain_seconds)   # tokens, plain rows' time
        if rows > seqs:
            self._row_cost.setdefault(seqs, _Ratio(_WEIGHT)).add(
                (seconds / plain_seconds - 1) * seqs, rows - seqs)
        promised = self._promised.get(seqs)
        if promised is not None and (real.samples >= _TRUST_SAMPLES
                                     or real.value < 1 + BATCH_GAIN):
            del self._promised[seqs]
            self.shadow_trust = min(1.0, real.value / promised)
        if seqs not in self._closed and real.value < 1 + BATCH_GAIN:
            self._closed.add(seqs)
            logger.info("speculation off at %d sequences: drafted steps gave %.2fx the "
                        "tokens per second of plain ones", seqs, real.value)
        elif seqs in self._closed and real.value >= 1 + REOPEN_GAIN:
            self._open([seqs])
            logger.info("speculation on again at %d sequences: drafted steps gave %.2fx "
                        "the tokens per second of plain ones", seqs, real.value)

    def record_shadow(self, seqs: int, rows: int, tokens: int) -> None:
        """Shadow drafts over ``seqs`` sequences (``rows`` rows with their drafts) would
        have given ``tokens`` tokens: a closed ``seqs`` opens again, and every smaller
        size with it, once enough such estimates clear ``1 + REOPEN_GAIN``."""
        near = self._nearest(self._row_cost, seqs)
        if seqs <= 0 or rows < seqs or self.is_open(seqs) or near is None:
            return
        per_row = max(0.0, self._row_cost[near].value)
        shadow = self._shadow.setdefault(seqs, _Ratio(_SHADOW_WEIGHT))
        shadow.add(tokens, seqs + per_row * (rows - seqs))
        if shadow.samples < SHADOW_SAMPLES or shadow.value * self.shadow_trust < 1 + REOPEN_GAIN:
            return
        # what pays at this size pays at smaller ones (their rows cost less): their
        # older verdicts go too
        smaller = [b for b in self._real if b < seqs]
        for b in smaller:
            del self._real[b]
        # the drafted steps that follow are judged on their own (and judge the shadows)
        self._real[seqs] = _Ratio(_WEIGHT)
        self._promised[seqs] = shadow.value
        self._open([seqs, *smaller])
        logger.info("speculation on again at %d sequences and fewer: shadow drafts estimate "
                    "%.2fx the tokens per second of plain steps (trusted at %.2f)", seqs,
                    shadow.value, self.shadow_trust)

    def _open(self, sizes: list[int]) -> None:
        """``sizes`` are open again; every size now open starts its next closing's
        evidence (shadows, retry waits) afresh."""
        self._closed.difference_update(sizes)
        for table in (self._shadow, self._wait, self._retry_at):
            for b in [b for b in table if self.is_open(b)]:
                del table[b]

    def allows(self, seqs: int, step: int, retry: bool = True) -> bool:
        """Whether a decode step of ``seqs`` sequences may verify the engine's drafts:
        yes while ``seqs`` is open, else only at a retry (``retry``; without it, only
        shadow drafts can open it again)."""
        if self.is_open(seqs):
            return True
        if not retry:
            return False
        retry_at = self._retry_at.get(seqs)
        if retry_at is None:   # just closed: the first retry after the shortest wait
            self._retry_at[seqs] = step + self._wait.setdefault(seqs, self.retry_after)
            return False
        if step < retry_at:
            return False
        wait = self._wait.get(seqs, self.retry_after)
        self._wait[seqs] = min(2 * wait, self.max_retry_after)
        self._retry_at[seqs] = step + self._wait[seqs]
        return True


SHADOW_SAMPLES = 16   # shadow estimates needed before drafting opens again
REOPEN_GAIN = 0.25    # ... and the gain they (or a retried size's average) must show
# drafted steps of several sequences must realize this gain to stay on: drafts move the
# sequences of a batch apart (some accept, some do not), so with equal answer lengths they
# no longer end, nor their successors start, in the same steps, and each successor's
# prefill then takes a step of its own; that cost about 6% of a closed-loop run of fixed
# lengths at 8 streams on the default model, a cost no single step's timing shows
BATCH_GAIN = 0.05
# drafted steps after a shadow reopening that judge the shadows' promise
_TRUST_SAMPLES = 4
# one shadow step's estimate swings by +-30% around the mean on random text (its drafts
# are few): the shadow average is a plain mean up to 16 samples, a slow moving one after
_SHADOW_WEIGHT = 1 / 16


class _Ratio:
    """A ratio of two averages: the plain mean of the first ``1 / weight`` samples, then a
    moving average giving the newest ``weight``."""

    __slots__ = ("weight", "num", "den", "samples")

    def __init__(self, weight: float) -> None:
        self.weight = weight
        self.num = self.den = 0.0
        self.samples = 0

    def add(self, num: float, den: float) -> None:
        self.samples += 1
        w = max(1.0 / self.samples, self.weight)
        self.num = (1 - w) * self.num + w * num
        self.den = (1 - w) * self.den + w * den

    @property
    def value(self) -> float:
        return self.num / self.den
