"""Speculative decoding on the engine side: who speculates, how far, and what it yielded
(no torch).

Each step, before scheduling, :meth:`SpeculativeDecoder.propose` gives every running
decode a draft (``Request.spec_token_ids``) from the proposers of spec_decode/proposers.py
(or a draft model). The scheduler counts ``k + 1`` tokens of the budget for a sequence with
``k`` drafts and reserves KV slots for them without registering them in the prefix cache;
the runner verifies the drafts (spec_decode/verifier.py) and answers with the accepted
drafts plus one token of its own. :meth:`SpeculativeDecoder.on_step_done` then moves the
sequence's computed position past the accepted drafts (their KV is now valid), frees the
KV blocks that only rejected drafts used (`KVCacheManager.trim`) and updates statistics.

Adaptive k, per request: a moving average of the acceptance rate scales k down; under
``min_acceptance`` the request stops drafting for a back-off that doubles (4 .. 256 steps).
Suffix drafts carry their own confidence: no scaling, no back-off (it cost agent edits
~10% at c=1); their average, floored at 0.3, only feeds the plan below.

Adaptive, per step (spec_decode/cost_model.py): from decode-step times per row count,
drafts go to the requests most likely to have them accepted only while the step's
expected tokens per second still grow. Off while more than ``max_batch`` sequences run.

Uniform steps (n-gram and suffix proposers): when several sequences decode, every one gets
the same number of drafts ``L`` (longer drafts cut, shorter ones filled with a repeat of
their last token, itself a proposal the verifier may accept or reject like any other), with
``L`` chosen by the cost model (``uniform_draft_length``). Equal rows let the runner verify
the step as one compiled graph; unequal ones made it an eager step, slower than the drafts
could gain at 8 streams (docs/BENCHMARKS.md). A step that prefills (a running request's
prompt, or a waiting one the scheduler may admit) runs eagerly whatever the drafts, and its
draft rows cost more there: these methods draft in the decode-only steps around it.

The check on the plan (``DraftYield``, spec_decode/cost_model.py): from two sequences up,
drafted steps' realized tokens per second are compared with a plain step's; where they fall
short, steps of that batch size verify no drafts of the engine's own. n-gram and
suffix drafts are then still proposed now and then as shadow drafts, never verified but
compared with the tokens the sequences go on to generate (spec_decode/shadow_drafts.py),
and drafting opens again once they show it would pay; the draft model's proposals, too
dear to make for nothing, are retried in a drafted step after a wait that doubles.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional, Sequence

from llmserve.engine.kv.kv_cache_manager import KVCacheManager
from llmserve.engine.request import Request, RequestStatus
from llmserve.spec_decode.config import SpecDecodeConfig
from llmserve.spec_decode.cost_model import (
    DraftCandidate,
    DraftYield,
    StepCostModel,
    plan_drafts,
    uniform_draft_length,
)
from llmserve.spec_decode.proposers import NgramIndex, NgramProposer, PredictionState, Proposal, Proposer
from llmserve.spec_decode.shadow_drafts import ShadowDrafts, ShadowStep

logger = logging.getLogger(__name__)

_EMA_WEIGHT = 0.5          # weight of the newest acceptance rate in the moving average
_FULL_K_ACCEPTANCE = 0.6   # at or above this average acceptance a request drafts k tokens
_MIN_BACKOFF, _MAX_BACKOFF = 4, 256
# steps between two shadow steps (proposing for a batch costs ~0.2 ms a sequence)
_SHADOW_EVERY = 16


class SpecState:
    """Per-request speculation state (``Request.spec_state``)."""

    __slots__ = ("ema", "paused_until", "backoff", "prediction", "ngram_index", "draft_probs",
                 "from_prediction", "accepted_prediction", "fillers")

    def __init__(self, prediction: Optional[PredictionState] = None) -> None:
        self.ema = 1.0
        self.paused_until = 0
        self.backoff = _MIN_BACKOFF
        self.prediction = prediction
        self.ngram_index: Optional[NgramIndex] = None
        self.draft_probs: object = None      # the current draft's distributions (draft model)
        self.from_prediction = False         # the current draft replays the prediction
        self.accepted_prediction = 0
        self.fillers = 0                     # drafts at the end that only even out a step

    @property
    def rejected_prediction(self) -> int:
        """Predicted tokens that never made it into the output through verification."""
        if self.prediction is None:
            return 0
        return max(0, len(self.prediction.token_ids) - self.accepted_prediction)


@dataclass
class SpecDecodeStats:
    """Cumulative counters: drafts verified, accepted, and the acceptance-length histogram
    (``acceptance_lengths[a]``: verifications that accepted ``a`` drafts)."""

    proposed_tokens: int = 0
    accepted_tokens: int = 0
    num_verifications: int = 0
    acceptance_lengths: list[int] = field(default_factory=list)

    def as_engine_stats(self) -> dict:
        """The EngineStats fields of these counters."""
        return {"spec_proposed_tokens_total": self.proposed_tokens,
                "spec_accepted_tokens_total": self.accepted_tokens,
                "spec_acceptance_lengths": list(self.acceptance_lengths)}

    def record(self, drafted: int, accepted: int) -> None:
        self.proposed_tokens += drafted
        self.accepted_tokens += accepted
        self.num_verifications += 1
        if accepted >= len(self.acceptance_lengths):
            self.acceptance_lengths.extend([0] * (accepted + 1 - len(self.acceptance_lengths)))
        self.acceptance_lengths[accepted] += 1


class SpeculativeDecoder:
    """Proposes drafts for running decodes and settles them after verification.

    ``proposer``: the engine's method (n-gram or draft model), or None to speculate only
    for requests that bring a prediction.
    """

    def __init__(self, config: SpecDecodeConfig, proposer: Optional[Proposer] = None) -> None:
        self.config = config
        self.proposer = proposer
        self.predictor = NgramProposer(config.ngram_min, config.ngram_max, use_history=False)
        self.stats = SpecDecodeStats()
        self.costs = StepCostModel()
        self.yields = DraftYield()
        # while drafting does not pay, shadow drafts tell when it would (shadow_drafts.py)
        self.shadow: Optional[ShadowDrafts] = (
            ShadowDrafts() if proposer is not None and config.method in ("ngram", "suffix")
            else None)
        self._predicted: set[str] = set()    # live requests that bring a prediction
        self._next_shadow = 0                # the first step a shadow step may start at
        self._drafted: list[Request] = []    # requests given drafts by the last propose
        # drafts that carry a confidence of their own need no back-off (Adaptive k)
        self._confident = bool(getattr(proposer, "confident_drafts", False))

    def prediction_state(self, request_id: str, token_ids: Sequence[int]) -> SpecState:
        """The state of a request that brings a predicted output."""
        cfg = self.config
        self._predicted.add(request_id)
        return SpecState(PredictionState(token_ids, cfg.ngram_min, cfg.ngram_max))

    @property
    def active(self) -> bool:
        """Whether any running request can speculate (a method is on, or a prediction)."""
        return self.proposer is not None or bool(self._predicted)

    def release(self, request_id: str) -> None:
        """A request ended: the proposer drops what it keeps for it (a draft's KV)."""
        self._predicted.discard(request_id)
        if self.shadow is not None:
            self._settle_shadow(self.shadow.drop(request_id))
        release = getattr(self.proposer, "release", None)
        if release is not None:
            release(request_id)

    # ---- before scheduling -----------------------------------------------------------
    def propose(self, running: Sequence[Request], step: int, prefill_next: bool = False) -> None:
        """Set ``spec_token_ids`` of every running request (empty unless it decodes next
        and speculates this step). O(1) when nothing can speculate. ``prefill_next``: a
        waiting request may be admitted this step (module docstring, "Uniform steps")."""
        for req in self._drafted:
            req.spec_token_ids = []
        self._drafted = []
        if not self.active or len(running) > self.config.max_batch:
            return
        uniform = self.config.adaptive and self.config.method in ("ngram", "suffix")
        if uniform and (prefill_next or any(r.num_tokens - r.num_computed_tokens > 1
                                            for r in running)):
            # an eager step (it prefills): only drafts a client brought are verified there
            # (and a seeded request's, whose draws must not depend on the batch)
            running = [r for r in running if _seeded(r) or (
                r.spec_state is not None and r.spec_state.prediction is not None)]
        plain: list[Request] = []
        plain_k: list[int] = []
        predicted: list[Request] = []
        predicted_k: list[int] = []
        wanted: list[tuple[Request, SpecState, int]] = []
        decoding: list[Request] = []
        for req in running:
            if req.num_tokens - req.num_computed_tokens != 1 or req.is_embedding:
                continue   # prefills (an embedding request never decodes)
            if _constrained(req):
                uniform = False   # a constrained row verifies no draft: the step is uneven
                continue
            if _seeded(req):
                uniform = False   # its drafts, and so its draws, are its own (_seeded)
            decoding.append(req)
            state = req.spec_state
            if state is None:
                if self.proposer is None:
                    continue
                state = req.spec_state = SpecState()
            k = self._num_drafts(req, state, step)
            if k > 0:
                wanted.append((req, state, k))
        track = getattr(self.proposer, "track", None)
        if track is not None:   # suffix: drafted for or not, every output joins the cache
            track(decoding)
        shadow = False
        if wanted and self.config.adaptive and not self.yields.allows(
                len(running), step, retry=self.shadow is None):
            # drafted steps of this size have not paid: only a client's or a seeded
            # request's drafts are verified (until a retry, or shadows show it would pay)
            fixed = [w for w in wanted if w[1].prediction is not None or _seeded(w[0])]
            shadow = (not fixed and self.shadow is not None and not self.shadow.following
                      and step >= self._next_shadow)
            if shadow:
                self._next_shadow = step + _SHADOW_EVERY
            else:
                wanted = fixed
        if wanted and self.config.adaptive and not self.costs.explores(step):
            wanted = self._plan(wanted, len(running))
        for req, state, k in wanted:
            if state.prediction is not None:
                predicted.append(req)
                predicted_k.append(k)
            elif self.proposer is not None:
                plain.append(req)
                plain_k.append(k)
        if predicted:
            for req, k, prop in zip(predicted, predicted_k,
                                    self.predictor.propose(predicted, predicted_k)):
                if prop.token_ids:
                    self._set(req, prop, k)
                elif self.proposer is not None:
                    plain.append(req)
                    plain_k.append(k)
        if plain:
            for req, k, prop in zip(plain, plain_k, self.proposer.propose(plain, plain_k)):
                self._set(req, prop, k)
        if uniform and not predicted and len(decoding) > 1:
            self._even_out(decoding, step)
        if shadow:
            self._to_shadow(len(running))

    def _to_shadow(self, seqs: int) -> None:
        """Keep this step's drafts as a shadow step instead of verifying them."""
        drafts: dict[str, tuple[list[int], int]] = {}
        rows = seqs
        for req in self._drafted:
            fillers = req.spec_state.fillers if req.spec_state is not None else 0
            rows += len(req.spec_token_ids)
            drafts[req.request_id] = (req.spec_token_ids[:len(req.spec_token_ids) - fillers],
                                      req.num_tokens)
            req.spec_token_ids = []
            if req.spec_state is not None:
                req.spec_state.fillers = 0
        self._drafted = []
        if self.shadow is not None:
            self.shadow.start(seqs, rows, drafts)

    def _settle_shadow(self, step: Optional[ShadowStep]) -> None:
        """A shadow step every sequence has answered: its estimate to ``yields``."""
        if step is not None:
            self.yields.record_shadow(step.seqs, step.rows, step.seqs + step.matched)

    def _even_out(self, decoding: list[Request], step: int) -> None:
        """Give every decoding sequence ``L`` drafts (module docstring, "Uniform steps")."""
        lengths = [len(r.spec_token_ids) for r in decoding]
        if min(lengths) == max(lengths):
            return
        if self.costs.explores(step):
            length = max(lengths)
        else:
            length = uniform_draft_length(
                self.costs, lengths, [r.spec_state.ema if r.spec_state else 0.0 for r in decoding])
        drafted = set(map(id, self._drafted))
        for req in decoding:
            room = min(length, req.max_total_tokens - req.num_tokens - 1)
            drafts = req.spec_token_ids[:max(room, 0)]
            fill = max(room - len(drafts), 0)
            if fill:
                drafts = drafts + [drafts[-1] if drafts else req.all_token_ids[-1]] * fill
            if req.spec_state is not None:
                req.spec_state.fillers = fill
            req.spec_token_ids = drafts
            if drafts and id(req) not in drafted:
                self._drafted.append(req)

    def _plan(self, wanted: list[tuple[Request, SpecState, int]], num_running: int
              ) -> list[tuple[Request, SpecState, int]]:
        """The drafts that pay at this batch size (cost model); a request that brought a
        prediction keeps its drafts (its client asked for them)."""
        fixed: list[tuple[Request, SpecState, int]] = []
        free: list[tuple[Request, SpecState, int]] = []
        for w in wanted:
            (fixed if w[1].prediction is not None or _seeded(w[0]) else free).append(w)
        planned = plan_drafts(self.costs, num_running + sum(k for _, _, k in fixed),
                              [DraftCandidate(k, min(1.0, st.ema)) for _, st, k in free])
        return fixed + [(r, st, k) for (r, st, _), k in zip(free, planned) if k > 0]

    def _set(self, req: Request, prop: Proposal, k: int) -> None:
        self._drafted.append(req)
        state = req.spec_state
        state.fillers = 0
        req.spec_token_ids = list(prop.token_ids[:k])
        state.draft_probs = prop.draft_probs
        state.from_prediction = prop.from_prediction

    def _num_drafts(self, req: Request, state: SpecState, step: int) -> int:
        cfg = self.config
        k = cfg.num_speculative_tokens
        if cfg.adaptive and self._backs_off(state):
            if step < state.paused_until:
                return 0
            if state.ema < _FULL_K_ACCEPTANCE:
                k = max(1, round(k * state.ema / _FULL_K_ACCEPTANCE))
        return min(k, req.max_total_tokens - req.num_tokens - 1)   # the last is sampled

    # ---- after the step --------------------------------------------------------------
    def on_step_done(self, sched, result, kv: KVCacheManager, step: int,
                     seconds: Optional[float] = None) -> None:
        """Settle the verified drafts of a step (``sched``: SchedulerOutput, ``result``:
        StepOutput) before its tokens are appended; ``seconds``: how long the step took,
        from proposing its drafts to the runner's answer, recorded for decode-only steps
        (the cost model and the realized gain of drafted steps)."""
        decode_only = all(s.num_new_tokens - s.num_draft_tokens == 1 for s in sched.scheduled)
        if seconds is not None and self.active and decode_only:
            self.costs.record(sched.num_batched_tokens, seconds)
        following = self.shadow is not None and self.shadow.following
        drafted = [s for s in sched.scheduled if s.num_draft_tokens]
        if not drafted and not following:
            return
        if following and self.shadow is not None:
            self._settle_shadow(self.shadow.observe_step(
                [s.request for s in sched.scheduled],
                dict(zip(result.request_ids, result.token_ids))))
        if not drafted:
            return
        where = {rid: i for i, rid in enumerate(result.request_ids)}
        seqs = len(sched.scheduled)
        plain = self.costs.cost(seqs)
        # the check weighs the engine's own drafts, not a client's or a seeded one's
        if (seconds is not None and decode_only and plain is not None and self.config.adaptive
                and any(s.request.spec_state is not None
                        and s.request.spec_state.prediction is None
                        and not _seeded(s.request) for s in drafted)):
            self.yields.record(seqs, sum(len(t) for t in result.token_ids), seconds, plain,
                               rows=sched.num_batched_tokens)
        for s in drafted:
            req = s.request
            i = where.get(req.request_id)
            if i is None or req.status is not RequestStatus.RUNNING:
                continue  # failed or requeued in this step: it will be recomputed
            accepted = len(result.token_ids[i]) - 1
            if not 0 <= accepted <= s.num_draft_tokens:
                raise RuntimeError(f"runner returned {accepted + 1} tokens for "
                                   f"{req.request_id} with {s.num_draft_tokens} drafts")
            req.num_computed_tokens += accepted
            kv.trim(req, req.num_tokens + accepted + 1)
            state = req.spec_state
            # fillers (uniform steps) are no proposer's: statistics count a request's own
            fillers = state.fillers if state is not None else 0
            own = min(s.num_draft_tokens, len(req.spec_token_ids) - fillers)
            req.spec_token_ids = []
            if own <= 0:
                continue
            self.stats.record(own, min(accepted, own))
            if state is not None:
                if state.from_prediction:
                    state.accepted_prediction += accepted
                self._adapt(state, min(accepted, own) / own, step)

    def _adapt(self, state: SpecState, rate: float, step: int) -> None:
        state.ema = (1 - _EMA_WEIGHT) * state.ema + _EMA_WEIGHT * rate
        if not self.config.adaptive:
            return
        if not self._backs_off(state):   # the plan's estimate, never below a short draft's
            state.ema = max(state.ema, _FULL_K_ACCEPTANCE / 2)
        elif state.ema < self.config.min_acceptance:
            state.paused_until = step + state.backoff
            state.backoff = min(2 * state.backoff, _MAX_BACKOFF)
            state.ema = _FULL_K_ACCEPTANCE / 2   # resume carefully: a short draft
        elif rate >= 0.5:
            state.backoff = max(_MIN_BACKOFF, state.backoff // 2)

    def _backs_off(self, state: SpecState) -> bool:
        """Whether a request pauses after low acceptance: not with a proposer's confident
        drafts (suffix decoding); a client's prediction does."""
        return not self._confident or state.prediction is not None


def _seeded(req: Request) -> bool:
    """A seeded sampled request verifies each step's drafts with ``k + 2`` numbers from its
    own generator, so its tokens depend on its ``k`` at every step: its drafts are planned
    from its own history only (no cost model, no uniform step, no prefill rule), so the
    same request gives the same tokens whatever shares its steps."""
    params = req.sampling_params
    return params.seed is not None and params.temperature > 0


def _constrained(req: Request) -> bool:
    """Requests under a grammar or with logit_bias do not speculate: the verifier scores
    drafts with the unadjusted distribution, so their drafts could break the constraint."""
    return req.sampling_params.adjusts_logits
