"""Shadow drafts: what speculation would yield, measured without verifying anything (no torch).

While drafting is off at a batch size (:class:`~llmserve.spec_decode.cost_model.DraftYield`
found that its drafted steps did not pay), the engine still needs to notice when they would
pay again. Verifying a trial draft costs rows, and it moves the sequences that accept it
ahead of the rest of their batch: with fixed answer lengths a batch that decoded in step
would then end, and admit its successors, one by one, each prefilled in an eager step of
its own (docs/SPECULATIVE.md). So instead, for a proposer whose drafts are cheap (n-gram,
suffix), a step's drafts are planned as usual but not verified: each sequence's draft is
kept here and compared with the tokens the sequence then generates, one per step. A draft
``d_1..d_n`` that the next ``m`` tokens match is what verification would have accepted
(the verifier keeps the longest prefix its own token agrees with: under greedy decoding
exactly this; under sampling, a one-hot draft token is accepted with the probability that
sampling draws it). Once every sequence of the step has answered, the step's estimate
(``B`` plus the matched tokens, in the rows it would have had) goes to ``DraftYield``.

One shadow step is followed at a time; a sequence that ends, is preempted or is not
scheduled in a step answers with the tokens matched so far.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from llmserve.engine.request import Request, RequestStatus


@dataclass
class ShadowStep:
    """A drafted decode step that was planned, not run: ``seqs`` sequences, ``rows`` rows
    (sequences plus drafts, fillers included), and the tokens its drafts would have added."""

    seqs: int
    rows: int
    matched: int = 0


class _Draft:
    __slots__ = ("tokens", "first", "matched")

    def __init__(self, tokens: list[int], first: int) -> None:
        self.tokens = tokens   # the draft, without fillers
        self.first = first     # the position its first token predicts
        self.matched = 0


class ShadowDrafts:
    """The shadow step being followed, if any (module docstring)."""

    def __init__(self) -> None:
        self._step: Optional[ShadowStep] = None
        self._drafts: dict[str, _Draft] = {}

    @property
    def following(self) -> bool:
        """Whether a shadow step still waits for some of its sequences' tokens."""
        return self._step is not None

    def start(self, seqs: int, rows: int, drafts: dict[str, tuple[list[int], int]]) -> None:
        """Follow a step of ``seqs`` sequences and ``rows`` rows whose drafts were
        ``drafts[request_id] = (tokens, position of the first)``."""
        if self._step is not None:
            raise RuntimeError("a shadow step is already being followed")
        live = {rid: _Draft(list(t), first) for rid, (t, first) in drafts.items() if t}
        if not live:
            return
        self._step = ShadowStep(seqs, rows)
        self._drafts = live

    def observe(self, request_id: str, position: int, token: int) -> Optional[ShadowStep]:
        """``request_id`` generated ``token`` at ``position``; the step once every
        sequence of it has answered, else None."""
        draft = self._drafts.get(request_id)
        if draft is None:
            return None
        if (position == draft.first + draft.matched and draft.matched < len(draft.tokens)
                and draft.tokens[draft.matched] == token):
            draft.matched += 1
            if draft.matched < len(draft.tokens):
                return None
        return self.drop(request_id)

    def drop(self, request_id: str) -> Optional[ShadowStep]:
        """``request_id`` answers with the tokens matched so far (it ended, was preempted,
        or its draft is settled); the step once every sequence has answered."""
        draft = self._drafts.pop(request_id, None)
        step = self._step
        if draft is None or step is None:
            return None
        step.matched += draft.matched
        if self._drafts:   # others still to answer
            return None
        self._step = None
        return step

    def observe_step(self, scheduled: Sequence[Request],
                     tokens: dict[str, list[int]]) -> Optional[ShadowStep]:
        """Compare the followed drafts with a step's tokens (``tokens[request_id]``, before
        they are appended to ``scheduled``); the step once every sequence has answered.
        A followed sequence the step left out, or that produced nothing, answers now."""
        settled = None
        ids = {req.request_id for req in scheduled}
        for rid in list(self._drafts):   # (drop() removes entries)
            if rid not in ids:   # preempted, or left out of this step
                settled = self.drop(rid) or settled
        for req in scheduled:
            new = tokens.get(req.request_id)
            if not new or req.status is not RequestStatus.RUNNING:
                settled = self.drop(req.request_id) or settled
            else:
                settled = self.observe(req.request_id, req.num_tokens, new[0]) or settled
        return settled
