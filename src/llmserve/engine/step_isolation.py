"""Re-running a failed engine step without its culprits (no torch).

`execute_isolated` wires the generic `isolate_failures` (engine/isolation.py) to a
scheduler step: the items are the step's `ScheduledRequest`s, a subset runs as a
`SchedulerOutput` holding only those, and an item depends on another when it reads a KV
block the other writes in this step (a same-step prefix-cache hit). The runner's results
of the groups that succeeded are merged into one output in the shape the engine core
reads (`request_ids`, `token_ids`, `logprobs`, `top_logprobs`).

Re-running is safe because a step's KV writes are idempotent (the same tokens at the same
positions), and the sampler restores seeded generators when it raises, so a request
re-run in a smaller group draws exactly what it would have drawn alone.
"""
from __future__ import annotations

import dataclasses
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from llmserve.engine.isolation import isolate_failures
from llmserve.engine.scheduler import ScheduledRequest, SchedulerOutput
from llmserve.engine.step_types import NonFiniteLogitsError, StepOutput
from llmserve.protocol import RequestFailedError

logger = logging.getLogger(__name__)

#: Exceptions that mean the request's own input could not be run (answered with a 4xx).
INPUT_ERRORS = (ValueError, OverflowError)


MergedOutput = StepOutput  # the runner outputs of several groups of one step, concatenated


@dataclass
class StepFailures:
    """Requests of a step that did not run: culprits (with the error for their caller)
    and deferred requests (to requeue), plus the KV blocks they were to write."""

    failed: list[tuple[ScheduledRequest, RequestFailedError]] = field(default_factory=list)
    deferred: list[ScheduledRequest] = field(default_factory=list)
    written_blocks: list[int] = field(default_factory=list)
    reruns: int = 0   # how many times (part of) the step ran again to find them


def blocks_written(item: ScheduledRequest, table: list[int], block_size: int) -> list[int]:
    """Ids of the blocks `item` writes KV into in its step."""
    first = item.start // block_size
    last = -(-(item.start + item.num_new_tokens) // block_size)
    return table[first:last]


def blocks_read(item: ScheduledRequest, table: list[int], block_size: int) -> list[int]:
    """Ids of the blocks `item`'s attention reads in its step (its whole context)."""
    return table[:-(-(item.start + item.num_new_tokens) // block_size)]


def subset(sched: SchedulerOutput, items: list[ScheduledRequest]) -> SchedulerOutput:
    """The step `sched` restricted to `items` (same step number)."""
    return dataclasses.replace(
        sched, scheduled=list(items),
        num_batched_tokens=sum(s.num_new_tokens for s in items),
        num_prefill_tokens=sum(s.num_new_tokens - s.num_draft_tokens for s in items
                               if s.request.num_tokens - s.start > 1))


def request_error(item: ScheduledRequest, exc: BaseException, step: int) -> RequestFailedError:
    """The error a culprit's caller gets; the traceback is logged under its error id."""
    error_id = "err-" + uuid.uuid4().hex[:16]
    rid = item.request.request_id
    logger.error("request %s failed the model step %d alone (error id %s)", rid, step,
                 error_id, exc_info=exc)
    if isinstance(exc, NonFiniteLogitsError):
        return RequestFailedError(
            f"the model produced NaN or infinite logits for this request (a broken adapter or "
            f"a numeric overflow; error id {error_id})", error_id=error_id, input_error=False)
    if isinstance(exc, INPUT_ERRORS):
        return RequestFailedError(
            f"the request could not be run with its parameters: {exc} (error id {error_id})",
            error_id=error_id, input_error=True)
    return RequestFailedError(
        f"the engine failed while running this request (error id {error_id})",
        error_id=error_id, input_error=False)


def merge_outputs(results: list[Any]) -> Any:
    """One output from several groups' (a lone result is returned as is)."""
    if len(results) == 1:
        return results[0]
    merged = MergedOutput()
    want_lp = any(r.logprobs is not None for r in results)
    want_top = any(r.top_logprobs is not None for r in results)
    lps: list[Any] = []
    tops: list[Any] = []
    for r in results:
        n = len(r.request_ids)
        merged.request_ids.extend(r.request_ids)
        merged.token_ids.extend(r.token_ids)
        lps.extend(r.logprobs if r.logprobs is not None else [None] * n)
        tops.extend(r.top_logprobs if r.top_logprobs is not None else [None] * n)
    merged.logprobs = lps if want_lp else None
    merged.top_logprobs = tops if want_top else None
    for r in results:
        merged.pooled.update(r.pooled)
    scored = [r.prompt_logprobs for r in results if r.prompt_logprobs]
    if scored:
        merged.prompt_logprobs = {rid: entry for part in scored for rid, entry in part.items()}
    return merged


def execute_isolated(
    execute: Callable[[SchedulerOutput], Any],
    sched: SchedulerOutput,
    tables: dict[str, list[int]],
    first_error: BaseException,
    block_size: int,
) -> tuple[Any, StepFailures]:
    """After ``execute(sched)`` raised ``first_error``: run the step's requests without the
    culprits; returns the merged output and what failed. ``tables``: each request's KV
    block ids (which blocks a request reads and writes)."""
    def table(item: ScheduledRequest) -> list[int]:
        return tables[item.request.request_id]

    def depends_on(item: ScheduledRequest, lost: list[ScheduledRequest]) -> bool:
        reads = set(blocks_read(item, table(item), block_size))
        return any(reads.intersection(blocks_written(o, table(o), block_size))
                   for o in lost if o is not item)

    named = set(first_error.request_ids) if isinstance(first_error, NonFiniteLogitsError) else set()
    known = [s for s in sched.scheduled if s.request.request_id in named]
    iso = isolate_failures(sched.scheduled, lambda items: execute(subset(sched, items)),
                           first_error, depends_on, known_culprits=known)
    failures = StepFailures(
        failed=[(item, request_error(item, exc, sched.step)) for item, exc in iso.failed],
        deferred=list(iso.deferred), reruns=iso.runs)
    for item in [f for f, _ in iso.failed] + iso.deferred:
        failures.written_blocks.extend(blocks_written(item, table(item), block_size))
    if iso.deferred:
        logger.warning("step %d: requeued %s (they read KV a failed request was to write)",
                       sched.step, [s.request.request_id for s in iso.deferred])
    logger.info("step %d isolated in %d extra run(s): %d failed, %d requeued, %d ran",
                sched.step, iso.runs, len(iso.failed), len(iso.deferred),
                sum(len(items) for items, _ in iso.results))
    return merge_outputs([r for _, r in iso.results]) if iso.results else MergedOutput(), failures
