"""Failure isolation for one engine step (no torch).

When the model runner raises on a batch, the step's scheduled items are run again in
halves, left to right, until every item has either run in a group that succeeded or
failed alone::

    [a b c d e f g h]  raised
    [a b c d]  ok          [e f g h]  raised
                           [e f]  raised      [g h]  ok
                           [e] ok  [f] raised -> f is a culprit

With ``k`` culprits among ``n`` items that costs at most about ``2 k log2(n)`` extra runs.
When the error itself names the culprits (a sampler that found NaN logits in some rows
says which), they fail at once and the others run again once: one extra run, not a search.

Items may depend on each other within a step: a request that hit, in the prefix cache,
blocks another request registers in the same step reads the KV that request writes.
Scheduled order is a topological order (the writer was scheduled first), so the halves
are resolved left to right, and an item whose writer failed (or was itself deferred) is
not run at all: it is *deferred*, and the caller requeues it to be recomputed.

The helper is generic over "a list of scheduled items -> run a subset"; the engine core
wires it to its runner and to the KV block tables (`EngineCore._execute_isolated`).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Generic, Optional, Sequence, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")


@dataclass
class IsolationResult(Generic[T, R]):
    """What isolating a failed step found.

    ``results``: each group of items that ran successfully with the runner's result;
    ``failed``: each culprit with the exception it raised when run alone;
    ``deferred``: items not run because they depend on a failed or deferred item;
    ``runs``: how many times the runner was called (the first, failed, call excluded).
    """

    results: list[tuple[list[T], R]] = field(default_factory=list)
    failed: list[tuple[T, BaseException]] = field(default_factory=list)
    deferred: list[T] = field(default_factory=list)
    runs: int = 0


def isolate_failures(
    items: Sequence[T],
    run: Callable[[list[T]], R],
    first_error: BaseException,
    depends_on: Optional[Callable[[T, list[T]], bool]] = None,
    known_culprits: Sequence[T] = (),
) -> IsolationResult[T, R]:
    """Find the items of a failed run that make ``run`` raise, and run the others.

    Args:
        items: the step's items, in scheduled (topological) order; ``run(items)`` has
            already raised ``first_error``.
        run: runs a subset (in the given order) and returns its result, or raises.
        first_error: the exception of the failed full run (reported for a lone item).
        depends_on: ``depends_on(item, others)`` is True when ``item`` reads what one of
            ``others`` writes in this step; such an item is deferred once one of them has
            failed or been deferred. None: the items are independent.
        known_culprits: items ``first_error`` names as its cause; they fail with it
            without being run again, and the rest is run as one group first.
    """
    out: IsolationResult[T, R] = IsolationResult()
    known = [item for item in items if any(item is c for c in known_culprits)]
    out.failed.extend((item, first_error) for item in known)

    def blocked(item: T) -> bool:
        if depends_on is None:
            return False
        lost = [f for f, _ in out.failed] + out.deferred
        return bool(lost) and depends_on(item, lost)

    def solve(group: list[T], known_error: Optional[BaseException]) -> None:
        runnable = []
        for item in group:
            if blocked(item):
                out.deferred.append(item)
            else:
                runnable.append(item)
        if not runnable:
            return
        if len(runnable) < len(group):
            known_error = None  # a different group now: it must be run to know
        error = known_error
        if error is None:
            out.runs += 1
            try:
                out.results.append((runnable, run(runnable)))
                return
            except Exception as exc:  # noqa: BLE001 - isolating it is the point
                error = exc
        if len(runnable) == 1:
            out.failed.append((runnable[0], error))
            return
        mid = len(runnable) // 2
        solve(runnable[:mid], None)
        solve(runnable[mid:], None)

    if known:
        solve([item for item in items if not any(item is c for c in known)], None)
    else:
        solve(list(items), first_error)
    return out
