"""Continuous-batching scheduler: one token budget per step, chunked prefill, priorities
with aging, recompute preemption and abort (no torch).

Each step it walks the requests in priority order and gives each the tokens it needs to
catch up with its tokens (1 for a decode, up to the rest of its prompt for a prefill)::

    budget = max_num_batched_tokens (2048)    prefill cap = max_prefill_tokens_per_step (512)
    1. running requests (they hold KV): decode tokens first, then unfinished prefills;
       when a block is missing, preempt the lowest-priority, latest-arrived running
       request not yet scheduled this step (recently preempted ones are spared)
    2. waiting requests (new and preempted), only if nobody was preempted this step:
       prefix-cache lookup, then as many prompt tokens as the budget allows (chunked)

The prefill cap bounds the prompt tokens of a step (all chunks together): a burst of
prompts starts a few requests a step beside the decodes of those already running, so first
tokens come out steadily and the requests' ends (and a closed-loop client's next requests)
do not arrive in lock-step.

Embedding requests (``Request.pooling``) are prefill-only: they share the budget and
the prefill cap like any prompt, never take speculative drafts, and the engine core
finishes them in the step that computes their last prompt token.

Waiting requests are ordered by class rank - aging_rate * seconds waited, then arrival
(lower runs first); running ones by class, decodes before prefills, then arrival. A
preemption victim never has a better class than the request that needs the blocks.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from llmserve.config import SchedulerConfig
from llmserve.engine.kv.kv_cache_manager import KVCacheManager
from llmserve.engine.request import Request, RequestStatus
from llmserve.lora.registry import AdapterStepBudget
from llmserve.protocol import FinishReason

logger = logging.getLogger(__name__)


@dataclass
class ScheduledRequest:
    request: Request
    start: int            # num_computed_tokens before this step
    num_new_tokens: int   # committed tokens plus draft tokens
    num_draft_tokens: int = 0  # speculative drafts at the end of the new tokens (verified)

    @property
    def committed_end(self) -> int:
        """Position after the last committed (non-draft) token this step computes."""
        return self.start + self.num_new_tokens - self.num_draft_tokens

    @property
    def samples(self) -> bool:
        """True when this step reaches the end of the request's tokens (a token is sampled)."""
        return self.committed_end == self.request.num_tokens


@dataclass
class SchedulerOutput:
    step: int
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_batched_tokens: int = 0
    num_prefill_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class PrefixCacheCounters:
    query_tokens: int = 0
    hit_tokens: int = 0
    query_by_tenant: dict[str, int] = field(default_factory=dict)
    hit_by_tenant: dict[str, int] = field(default_factory=dict)

    def record(self, tenant: Optional[str], queried: int, hit: int) -> None:
        self.query_tokens += queried
        self.hit_tokens += hit
        key = tenant or ""
        self.query_by_tenant[key] = self.query_by_tenant.get(key, 0) + queried
        self.hit_by_tenant[key] = self.hit_by_tenant.get(key, 0) + hit


class Scheduler:
    """Decides, every step, which requests run and how many tokens each computes."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager,
                 clock: Callable[[], float] = time.time, *, max_loras: int = 0,
                 admission_watermark_blocks: int = 0) -> None:
        """``max_loras``: the runner's LoRA slots (distinct adapters per step, 0: no LoRA);
        ``admission_watermark_blocks``: free blocks kept when admitting waiting requests."""
        self.config = config
        self.max_loras = max_loras
        self.admission_watermark_blocks = admission_watermark_blocks
        self.kv = kv
        self.clock = clock
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.step_index = 0
        self.num_preemptions = 0
        #: the last admission stopped at a waiting request whose KV did not fit (it may stay
        #: waiting for many steps: speculation should not wait for its prefill)
        self.admission_blocked = False
        self.num_aborted = 0
        self.prefix = PrefixCacheCounters()

    @property
    def may_admit(self) -> bool:
        """The next step may admit a waiting request (and so prefill): one waits, a
        sequence slot is free and the last admission was not stopped for KV."""
        return (bool(self.waiting) and len(self.running) < self.config.max_num_seqs
                and not self.admission_blocked)

    # ---- queue management ---------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the engine")
        need = self.kv.blocks_needed(request.max_total_tokens)
        if need > self.kv.num_blocks:
            raise ValueError(
                f"request needs {need} KV blocks ({request.max_total_tokens} tokens) but the whole "
                f"pool has {self.kv.num_blocks}"
            )
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort_request(self, request_id: str) -> Optional[Request]:
        """Remove a request wherever it is and free its KV now. None if unknown."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        self.num_aborted += 1
        self.finish_request(request, FinishReason.ABORT)
        return request

    def finish_request(self, request: Request, reason: FinishReason, stop_reason: "str | int | None" = None) -> None:
        """Mark a request finished, drop it from its queue and free its blocks."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status.is_waiting:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.stop_reason = stop_reason
        request.metrics.finished_time = self.clock()
        self.kv.free(request)
        self.requests.pop(request.request_id, None)

    def requeue(self, request: Request) -> None:
        """Send a running request back to the waiting queue, its KV freed, to be
        recomputed (like a preemption, without counting as one)."""
        if request.status is not RequestStatus.RUNNING:
            return
        self._send_back(request)

    def _send_back(self, request: Request) -> None:
        """Free a running request's KV and queue it to be recomputed from its first token
        (its old arrival time puts it first in its class)."""
        self.running.remove(request)
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        self.waiting.append(request)

    def _key(self, request: Request, now: float) -> tuple[float, float]:
        waited = now - request.arrival_time
        return (request.priority - self.config.aging_rate * waited, request.arrival_time)

    # ---- the step -----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        now = self.clock()
        self.step_index += 1
        out = SchedulerOutput(step=self.step_index)
        budget = cfg.max_num_batched_tokens
        prefill_cap = cfg.max_prefill_tokens_per_step or budget
        scheduled_ids: set[str] = set()
        adapters = AdapterStepBudget(self.max_loras)   # the runner's LoRA slots

        # running requests by class; within a class decodes before unfinished prefills
        # (inter-token latency), then by arrival
        self.running.sort(key=lambda r: (r.priority, r.num_tokens - r.num_computed_tokens > 1,
                                         r.arrival_time))
        order = list(self.running)
        for request in order:
            if budget <= 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            if not adapters.admits(request.lora):
                continue  # every LoRA slot is taken this step; it runs in a later one
            remaining = request.num_tokens - request.num_computed_tokens
            is_prefill = remaining > 1
            num_new = min(remaining, budget, prefill_cap if is_prefill else remaining)
            if num_new <= 0:
                continue
            # a decode verifies its speculative drafts too (k + 1 tokens of the budget);
            # drafts never preempt anyone: without room they are dropped
            # (an embedding request never decodes: it takes no drafts)
            drafts = 0 if is_prefill or request.is_embedding else min(
                len(request.spec_token_ids), budget - num_new)
            if not (drafts and self.kv.allocate_slots(request, num_new,
                                                      num_lookahead_tokens=drafts)):
                drafts = 0
                while not self.kv.allocate_slots(request, num_new):
                    victim = self._pick_victim(scheduled_ids | {request.request_id})
                    if victim is None or victim.priority < request.priority:
                        victim = request  # never evict someone more important
                    self._preempt(victim, out)
                    if victim is request:
                        break
            if request.status is not RequestStatus.RUNNING:
                continue
            self._add(out, request, num_new, is_prefill, scheduled_ids, drafts)
            budget -= num_new + drafts
            if is_prefill:
                prefill_cap -= num_new

        if not out.preempted:
            self.waiting.sort(key=lambda r: self._key(r, now))
            admitted = []
            self.admission_blocked = False
            for request in self.waiting:
                if budget <= 0 or prefill_cap <= 0 or len(self.running) >= cfg.max_num_seqs:
                    break
                if not adapters.admits(request.lora):
                    continue  # its adapter would need a LoRA slot this step does not have
                cached = self.kv.find_cached_prefix(request)
                num_cached = len(cached) * self.kv.block_size
                remaining = request.num_tokens - num_cached
                num_new = min(remaining, budget, prefill_cap if remaining > 1 else remaining)
                # the watermark keeps room for running decodes; with nothing running it
                # would only stop a request that fits the pool from ever starting
                reserve = self.admission_watermark_blocks if self.running else 0
                if not self.kv.allocate_slots(request, num_new, cached, reserve=reserve):
                    self.admission_blocked = True
                    break  # keep priority order: nobody jumps a request that does not fit
                first_time = request.num_cached_tokens < 0
                if first_time:
                    # hits after a preemption are recomputation, not prefix-cache hits
                    request.num_cached_tokens = num_cached
                    self.prefix.record(request.cache_salt, request.num_prompt_tokens, num_cached)
                    self.kv.record_hit(request, cached)
                    request.metrics.first_scheduled_time = now
                request.num_computed_tokens = num_cached
                request.status = RequestStatus.RUNNING
                self.running.append(request)
                admitted.append(request)
                self._add(out, request, num_new, remaining > 1, scheduled_ids)
                budget -= num_new
                if remaining > 1:
                    prefill_cap -= num_new
            if admitted:
                gone = {r.request_id for r in admitted}
                self.waiting = [r for r in self.waiting if r.request_id not in gone]
        return out

    def _add(self, out: SchedulerOutput, request: Request, num_new: int, is_prefill: bool,
             scheduled_ids: set[str], num_drafts: int = 0) -> None:
        out.scheduled.append(ScheduledRequest(request, request.num_computed_tokens,
                                              num_new + num_drafts, num_drafts))
        out.num_batched_tokens += num_new + num_drafts
        if is_prefill:
            out.num_prefill_tokens += num_new
        scheduled_ids.add(request.request_id)

    def _pick_victim(self, exclude: set[str]) -> Optional[Request]:
        """Lowest priority, most recent arrival; spare recently preempted requests if possible."""
        now = self.clock()
        candidates = [r for r in self.running if r.request_id not in exclude]
        if not candidates:
            return None
        cooldown = self.config.preemption_cooldown_steps
        fresh = [r for r in candidates if self.step_index - r.last_preempted_step > cooldown]
        pool = fresh or candidates
        return max(pool, key=lambda r: self._key(r, now))

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self._send_back(request)
        request.num_preemptions += 1
        request.last_preempted_step = self.step_index
        self.num_preemptions += 1
        out.preempted.append(request)
        logger.debug("preempted %s", request.request_id)

    def on_step_done(self, out: SchedulerOutput) -> None:
        """Advance progress of every request that ran in this step (draft positions count
        only once accepted: the engine core adds them after verification)."""
        for s in out.scheduled:
            if s.request.status is RequestStatus.RUNNING:
                s.request.num_computed_tokens = s.committed_end
