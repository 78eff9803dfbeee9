"""EngineCore: schedule -> execute -> sample -> update, one step at a time (no torch).

The model runner is injected (anything with ``execute(StepInput) -> StepOutput`` and
``release(request_id)``), so this module, like the scheduler and the block manager,
imports no torch and can be driven by a fake runner in tests. The runner sees only the
typed step messages of ``step_types``, never a ``Request``.

A runner that raises fails only the requests that make it raise: `_execute_isolated`
re-runs the step's requests in halves (engine/isolation.py, step_isolation.py), fails
each culprit alone (finish reason "error", a `RequestFailedError` for its caller),
requeues the requests that read KV a culprit was to write, and the rest continue with
the tokens they would have produced alone.
"""
from __future__ import annotations

import logging
from typing import Optional, Protocol

from llmserve.engine.kv.kv_cache_manager import KVCacheManager
from llmserve.engine.output.processor import OutputProcessor
from llmserve.engine.request import Request, RequestStatus
from llmserve.engine.scheduler import Scheduler, SchedulerOutput
from llmserve.engine.step_isolation import StepFailures, execute_isolated
from llmserve.engine.step_types import SequencePooling, SequenceSampling, StepInput, StepOutput
from llmserve.protocol import CompletionOutput, EngineStats, FinishReason, RequestFailedError
from llmserve.spec_decode.decoder import SpecState, SpeculativeDecoder

logger = logging.getLogger(__name__)


class Runner(Protocol):
    """What the core drives: the model executor (or a fake runner in tests)."""

    #: resident weight bytes and KV bytes per token, reported in the engine's stats
    weight_bytes: int
    kv_bytes_per_token: int

    def execute(self, step: StepInput) -> StepOutput:
        """Run one step: the sampled tokens of the sequences that sample."""
        ...

    def release(self, request_id: str) -> None:
        """Forget what is held for a finished request."""
        ...


def build_step_input(sched: SchedulerOutput, kv: KVCacheManager) -> StepInput:
    """The scheduler's decision as a torch-free StepInput (O(new tokens + block tables))."""
    step = StepInput()
    for s in sched.scheduled:
        req = s.request
        nd = s.num_draft_tokens
        end = s.committed_end
        tokens = req.all_token_ids[s.start:end]
        sampling = None
        if req.pooling is not None:   # prefill only: pooled, never sampled
            step.add(req.request_id, tokens, s.start, kv.blocks_of(req.request_id), 0, None,
                     req.lora)
            step.pooling[req.request_id] = SequencePooling(req.pooling,
                                                           end == req.num_prompt_tokens)
            continue
        if s.samples:
            sampling = SequenceSampling(req.sampling_params, req.prompt_token_ids,
                                        req.output_token_ids)
        if nd:  # speculative drafts: verified at their positions, k + 1 samples
            tokens = tokens + req.spec_token_ids[:nd]
            probs = getattr(req.spec_state, "draft_probs", None)
            if sampling is not None:
                sampling.draft_probs = None if probs is None else probs[:nd]
        step.add(req.request_id, tokens, s.start, kv.blocks_of(req.request_id),
                 1 + nd if s.samples else 0, sampling, req.lora)
        k = req.sampling_params.prompt_logprobs
        if k is not None and s.start + 1 < req.num_prompt_tokens:
            step.prompt_logprob_targets[req.request_id] = (
                k, req.prompt_token_ids[s.start + 1:min(end + 1, req.num_prompt_tokens)])
    return step


class SequenceUpdate:
    """What one step did to one sequence: a delta plus, maybe, its end (and, for an
    embedding request, its vector)."""

    __slots__ = ("request", "delta", "error", "embedding")

    def __init__(self, request: Request, delta: CompletionOutput,
                 error: Optional[RequestFailedError] = None,
                 embedding: Optional[list[float]] = None) -> None:
        self.request = request
        self.delta = delta
        self.error = error
        self.embedding = embedding


class EngineCore:
    """Owns the scheduler, the KV manager and the runner; `step()` advances every sequence."""

    def __init__(self, scheduler: Scheduler, runner: Runner, outputs: OutputProcessor,
                 check_invariants: bool = False,
                 spec: Optional[SpeculativeDecoder] = None) -> None:
        self.scheduler = scheduler
        self.spec = spec   # speculative decoding (spec_decode/decoder.py), or None
        self.kv: KVCacheManager = scheduler.kv
        self.runner = runner
        self.outputs = outputs
        self.check_invariants_each_step = check_invariants
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.num_step_errors = 0
        self.num_step_reruns = 0
        self._timed: dict[str, Request] = {}   # requests with a deadline or queue deadline

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)
        if request.deadline is not None or request.queue_deadline is not None:
            self._timed[request.request_id] = request

    def abort_request(self, request_id: str, reason: FinishReason = FinishReason.ABORT
                      ) -> Optional[SequenceUpdate]:
        """End a sequence wherever it is; its KV is free when this returns."""
        request = self.scheduler.requests.get(request_id)
        self._timed.pop(request_id, None)
        if request is None:
            return None
        if reason == FinishReason.ABORT:
            self.scheduler.abort_request(request_id)
        else:
            self.scheduler.finish_request(request, reason)
        delta = self.outputs.finish_early(request, reason)
        self._forget(request_id)
        return SequenceUpdate(request, delta)

    def _forget(self, request_id: str) -> None:
        """Drop what the runner, the speculative decoder and the output processor hold for
        a sequence the scheduler has ended."""
        self.runner.release(request_id)
        if self.spec is not None:
            self.spec.release(request_id)
        self.outputs.release(request_id)

    def expire_deadlines(self, now: float) -> list[SequenceUpdate]:
        """End requests past their deadline ("timeout") or still queued past their queue
        deadline ("queue_timeout"); their KV is freed at once."""
        if not self._timed:
            return []
        expired = []
        for rid, r in list(self._timed.items()):
            if r.is_finished:
                del self._timed[rid]
            elif r.deadline is not None and r.deadline <= now:
                expired.append((r, FinishReason.TIMEOUT))
            elif (r.queue_deadline is not None and r.queue_deadline <= now
                  and r.metrics.first_scheduled_time is None):
                expired.append((r, FinishReason.QUEUE_TIMEOUT))
        out = []
        for r, reason in expired:
            upd = self.abort_request(r.request_id, reason)
            if upd is not None:
                out.append(upd)
        return out

    def step(self) -> list[SequenceUpdate]:
        # a step's seconds (the speculation cost model's) include proposing its drafts
        started = self.scheduler.clock()
        if self.spec is not None:
            sch = self.scheduler
            self.spec.propose(sch.running, sch.step_index + 1, prefill_next=sch.may_admit)
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        result, failures = self._execute_isolated(sched)
        seconds = None if failures else self.scheduler.clock() - started
        updates = self._settle_failures(failures) if failures else []
        self.scheduler.on_step_done(sched)
        if self.spec is not None:
            self.spec.on_step_done(sched, result, self.kv, sched.step, seconds)
        requests = self.scheduler.requests
        for rid, (first, entries) in (result.prompt_logprobs or {}).items():
            req = requests.get(rid)
            if req is not None:  # positions 1.., kept once (a recompute scores them again)
                have = req.prompt_logprobs = req.prompt_logprobs or []
                if len(have) == first - 1:
                    have.extend(entries)
        updates += self._finish_embeddings(sched, result)
        lps = result.logprobs
        tops = result.top_logprobs
        for i, rid in enumerate(result.request_ids):
            req = requests.get(rid)
            if req is None:
                continue
            upd = self._append_tokens(req, result.token_ids[i], lps[i] if lps else None,
                                      tops[i] if tops else None)
            if upd is not None:
                updates.append(upd)
        if self.check_invariants_each_step:
            self.kv.check_invariants()
        return updates

    def _append_tokens(self, req: Request, tokens: list[int], lps: Optional[list[float]],
                       tops: Optional[list]) -> Optional[SequenceUpdate]:
        """Append a sequence's accepted tokens in order; stop checks apply to each, and
        tokens after a stop are discarded."""
        deltas: list[CompletionOutput] = []
        for j, token in enumerate(tokens):
            req.append_token(token)
            self.generation_tokens_total += 1
            if req.num_output_tokens == 1 and req.index == 0:
                self.prompt_tokens_total += req.num_prompt_tokens
            try:
                step_delta, finish, stop_reason = self.outputs.process_token(
                    req, token, lps[j] if lps else None, tops[j] if tops else None)
            except Exception:  # noqa: BLE001 - one bad sequence must not stop the others
                logger.exception("output processing failed for %s; aborting it", req.request_id)
                return self.abort_request(req.request_id, FinishReason.ABORT)
            deltas.append(step_delta)
            if finish is not None:
                spec = req.spec_state
                if isinstance(spec, SpecState) and spec.prediction is not None:
                    step_delta.accepted_prediction_tokens = spec.accepted_prediction
                    step_delta.rejected_prediction_tokens = spec.rejected_prediction
                self.scheduler.finish_request(req, finish, stop_reason)
                self._forget(req.request_id)
                break
        return SequenceUpdate(req, CompletionOutput.joined(deltas)) if deltas else None

    def _finish_embeddings(self, sched: SchedulerOutput, result: StepOutput
                           ) -> list[SequenceUpdate]:
        """End the embedding requests whose prompt this step completed: their vector
        goes out, their KV blocks are freed (a prefix-cached block stays cached)."""
        updates = []
        for s in sched.scheduled:
            req = s.request
            if req.pooling is None or req.status is not RequestStatus.RUNNING \
                    or req.num_computed_tokens < req.num_prompt_tokens:
                continue
            vector = result.pooled.get(req.request_id)
            if vector is None:   # a runner that does not pool: a bug, not the request's
                logger.error("the runner returned no embedding for %s", req.request_id)
                upd = self.abort_request(req.request_id, FinishReason.ERROR)
                if upd is not None:
                    upd.error = RequestFailedError("the engine returned no embedding",
                                                   error_id=req.request_id)
                    updates.append(upd)
                continue
            self.prompt_tokens_total += req.num_prompt_tokens
            req.metrics.first_token_time = req.metrics.last_token_time = \
                self.scheduler.clock()
            self.scheduler.finish_request(req, FinishReason.STOP)
            self._forget(req.request_id)
            updates.append(SequenceUpdate(
                req, CompletionOutput(index=req.index, finish_reason=FinishReason.STOP),
                embedding=vector))
        return updates

    def _execute_isolated(self, sched: SchedulerOutput
                          ) -> tuple[StepOutput, Optional[StepFailures]]:
        """The runner's result for the step; if it raised, the merged results of the
        requests that run fine without the culprits, and what failed (see step_isolation)."""
        try:
            return self.runner.execute(build_step_input(sched, self.kv)), None
        except Exception as exc:  # noqa: BLE001 - isolate the culprits, keep the rest
            self.num_step_errors += 1
            logger.warning("engine step %d failed (%r); isolating the failing request(s)",
                           sched.step, exc)
            tables = {s.request.request_id: self.kv.blocks_of(s.request.request_id)
                      for s in sched.scheduled}
            return execute_isolated(
                lambda sub: self.runner.execute(build_step_input(sub, self.kv)),
                sched, tables, exc, self.kv.block_size)

    def _settle_failures(self, failures: StepFailures) -> list[SequenceUpdate]:
        """Fail the culprits, requeue what depended on them; drop their blocks' hashes
        (the KV those blocks should hold this step was never written)."""
        self.num_step_reruns += failures.reruns
        self.kv.drop_cached_blocks(failures.written_blocks)
        for s in failures.deferred:
            self.scheduler.requeue(s.request)
        updates = []
        for s, error in failures.failed:
            upd = self.abort_request(s.request.request_id, FinishReason.ERROR)
            if upd is not None:
                upd.error = error
                updates.append(upd)
        return updates

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(
            num_running=len(s.running),
            num_waiting=len(s.waiting),
            kv_blocks_used=self.kv.num_used_blocks,
            kv_blocks_total=self.kv.num_blocks,
            kv_blocks_high_water=self.kv.high_water,
            num_preemptions=s.num_preemptions,
            num_aborted=s.num_aborted,
            prefix_query_tokens=s.prefix.query_tokens,
            prefix_hit_tokens=s.prefix.hit_tokens,
            prefix_query_tokens_by_tenant=dict(s.prefix.query_by_tenant),
            prefix_hit_tokens_by_tenant=dict(s.prefix.hit_by_tenant),
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            num_steps=s.step_index,
            num_step_errors=self.num_step_errors,
            num_step_reruns=self.num_step_reruns,
            weight_bytes=self.runner.weight_bytes,
            kv_bytes_per_token=self.runner.kv_bytes_per_token,
            block_size=self.kv.block_size,
            max_loras=s.max_loras,
            lora_running=sorted({r.lora.name for r in s.running if r.lora is not None}),
            lora_waiting=sorted({r.lora.name for r in s.waiting if r.lora is not None}),
            **(self.spec.stats.as_engine_stats() if self.spec is not None else {}),
        )
