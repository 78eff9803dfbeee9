"""Turns each sampled token into user-visible output and decides when a sequence stops (no torch).

Per token, in order:
  1. stop token: EOS (unless ignore_eos) or one of stop_token_ids -> finish "stop";
  2. incremental detokenization (never half a UTF-8 character), then stop strings: text
     that might begin a stop string is held back; a match truncates and finishes "stop";
  3. length: max_tokens reached, or the context (max_model_len) is full -> finish "length".
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional, Sequence

from llmserve.engine.output.detokenizer import IncrementalDetokenizer
from llmserve.engine.output.stop_checker import StopStringMatcher
from llmserve.engine.request import Request
from llmserve.protocol import CompletionOutput, FinishReason, TokenLogprob, TopLogprob


@dataclass
class _SeqState:
    detok: IncrementalDetokenizer
    stops: Optional[StopStringMatcher]


class OutputProcessor:
    """Keeps per-sequence detokenizer and stop-string state."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, _SeqState] = {}
        self._piece_cache: dict[int, str] = {}

    def _state(self, req: Request) -> _SeqState:
        st = self._states.get(req.request_id)
        if st is None:
            p = req.sampling_params
            stops = (StopStringMatcher(p.stop_strings, p.include_stop_str_in_output)
                     if p.stop_strings else None)
            st = _SeqState(IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids,
                                                  p.skip_special_tokens), stops)
            self._states[req.request_id] = st
        return st

    def release(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def token_text(self, token_id: int) -> str:
        piece = self._piece_cache.get(token_id)
        if piece is None:
            # The token's own bytes: decoding it alone would drop a SentencePiece "▁" (space)
            # that starts it, as decoders strip the space the encoder prepended to the text.
            raw = getattr(self.tokenizer, "token_bytes", None)
            piece = (raw(token_id).decode("utf-8", errors="replace") if raw is not None
                     else self.tokenizer.decode([token_id], skip_special_tokens=False))
            self._piece_cache[token_id] = piece
        return piece

    def token_logprob(self, token_id: int, logprob: float,
                      top: Sequence[tuple[int, float]]) -> TokenLogprob:
        """A token's logprob entry with its text and its ``(token, logprob)`` alternatives
        (sampled tokens and prompt tokens alike)."""
        return TokenLogprob(token_id, self.token_text(token_id), logprob,
                            [TopLogprob(t, self.token_text(t), lp) for t, lp in top])

    def process_token(
        self, req: Request, token_id: int,
        logprob: Optional[float] = None,
        top: Optional[list[tuple[int, float]]] = None,
    ) -> tuple[CompletionOutput, Optional[FinishReason], "str | int | None"]:
        """Account one appended token. Returns (delta, finish_reason, stop_reason)."""
        p = req.sampling_params
        st = self._state(req)
        now = time.time()
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        req.metrics.last_token_time = now
        delta = CompletionOutput(index=req.index, token_ids=[token_id],
                                 num_tokens=req.num_output_tokens)
        if p.logprobs is not None and logprob is not None:
            delta.logprobs = [self.token_logprob(token_id, logprob, (top or [])[: p.logprobs])]
        finish: Optional[FinishReason] = None
        stop_reason: "str | int | None" = None
        # min_tokens never holds a grammar row open: the sampler lifts its EOS mask there, so
        # an EOS in such a row is the one a complete grammar forces, and it ends the row
        if req.num_output_tokens >= p.min_tokens or p.structured_output is not None:
            if p.stop_token_ids and token_id in p.stop_token_ids:
                finish, stop_reason = FinishReason.STOP, token_id
            elif not p.ignore_eos and token_id in req.eos_token_ids:
                finish = FinishReason.STOP
        at_length = req.num_tokens >= req.max_total_tokens
        ending = finish is not None or at_length
        # a stop token's own text is never shown
        text = st.detok.add_tokens([token_id]) if finish is None else ""
        if ending:
            text += st.detok.flush()
        if st.stops is not None and req.num_output_tokens >= p.min_tokens:
            # stop strings apply once min_tokens exist (text before that is never held back)
            text, matched = st.stops.feed(text)
            if matched is not None:
                if finish is None:
                    finish, stop_reason = FinishReason.STOP, matched
            elif ending:
                text += st.stops.flush()
                if st.stops.matched is not None and finish is None:
                    finish, stop_reason = FinishReason.STOP, st.stops.matched
        if finish is None and at_length:
            finish = FinishReason.LENGTH
        delta.text = text
        delta.finish_reason = finish
        delta.stop_reason = stop_reason
        return delta, finish, stop_reason

    def finish_early(self, req: Request, reason: FinishReason) -> CompletionOutput:
        """Final delta for a sequence ended from outside (abort, deadline): release held text."""
        st = self._states.get(req.request_id)
        text = ""
        if st is not None:
            text = st.detok.flush()
            if st.stops is not None:
                emit, matched = st.stops.feed(text)
                text = emit + ("" if matched else st.stops.flush())
        return CompletionOutput(index=req.index, text=text, num_tokens=req.num_output_tokens,
                                finish_reason=reason)
