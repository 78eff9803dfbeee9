"""Response bodies and stream chunks of the OpenAI-compatible API.

Finish reasons: the engine's ``stop`` and ``length`` pass through. ``timeout`` (the
request's deadline passed) and ``abort`` (the engine cancelled the request while the
client was still listening, e.g. at shutdown) are reported as ``length``: the output
was cut short by a limit, which is the closest OpenAI value, and clients written for
OpenAI handle it. A request that ends that way before producing any token is instead
answered with an error (503, code ``timeout`` / ``queue_timeout`` / ``request_aborted``),
see :func:`terminal_error`.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

from llmserve.contract.errors import OpenAIError
from llmserve.protocol import FinishReason, TokenLogprob

_FINISH_REASON_MAP = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.TIMEOUT: "length",
    FinishReason.QUEUE_TIMEOUT: "length",
    FinishReason.ABORT: "length",
}

_VALUES = frozenset(FinishReason)
_TERMINAL_CODES = {
    FinishReason.TIMEOUT: ("The request's deadline passed before any output", "timeout"),
    FinishReason.QUEUE_TIMEOUT: ("The request waited too long in the queue; retry later",
                                       "queue_timeout"),
    FinishReason.ABORT: ("The request was aborted by the server", "request_aborted"),
}


def openai_finish_reason(reason: Optional[str]) -> Optional[str]:
    """Map an engine finish reason to the OpenAI value (None stays None)."""
    if reason is None:
        return None
    return _FINISH_REASON_MAP.get(FinishReason(reason), "stop") if reason in _VALUES else "stop"


def terminal_error(reasons: Sequence[Optional[str]], tokens: Sequence[int]) -> Optional[OpenAIError]:
    """The error to send instead of a response when every choice ended without a token.

    Returns None when at least one choice produced output or ended normally.
    """
    if not reasons or any(t > 0 for t in tokens):
        return None
    codes = [_TERMINAL_CODES.get(FinishReason(r)) if r in _VALUES else None for r in reasons]
    if any(c is None for c in codes):
        return None
    message, code = codes[0] or ("", "")
    return OpenAIError(503, message, code=code, headers={"Retry-After": "1"})


def _token_bytes(token: str) -> list[int]:
    return list(token.encode("utf-8", errors="replace"))


def chat_logprobs(entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    """The chat ``logprobs`` object: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    content = []
    for e in entries:
        content.append({
            "token": e.token,
            "logprob": e.logprob,
            "bytes": _token_bytes(e.token),
            "top_logprobs": [
                {"token": t.token, "logprob": t.logprob, "bytes": _token_bytes(t.token)}
                for t in e.top_logprobs
            ],
        })
    return {"content": content}


def completion_logprobs(entries: Sequence[TokenLogprob], text_offset: int) -> dict[str, Any]:
    """The legacy completions ``logprobs`` object; offsets count characters of the output."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    offset = text_offset
    for e in entries:   # a null logprob (echo's first prompt token) has null alternatives
        tokens.append(e.token)
        token_logprobs.append(e.logprob)
        tops.append(None if e.logprob is None else {t.token: t.logprob for t in e.top_logprobs})
        offsets.append(offset)
        offset += len(e.token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
            "text_offset": offsets}


class ResponseHeader:
    """The fields every body or chunk of one response repeats."""

    def __init__(self, response_id: str, object_name: str, created: int, model: str,
                 fingerprint: str) -> None:
        self.response_id = response_id
        self.object_name = object_name
        self.created = created
        self.model = model
        self.fingerprint = fingerprint

    def body(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        out = {
            "id": self.response_id,
            "object": self.object_name,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fingerprint,
            "choices": choices,
        }
        out.update(extra)
        return out


def chat_chunk_choice(index: int, delta: dict[str, Any], finish_reason: Optional[str] = None,
                      logprobs: Optional[list[TokenLogprob]] = None,
                      want_logprobs: bool = False, stop_reason: Any = None) -> dict[str, Any]:
    """One choice of a streamed chat chunk."""
    out: dict[str, Any] = {
        "index": index,
        "delta": delta,
        "logprobs": chat_logprobs(logprobs or []) if want_logprobs and logprobs else None,
        "finish_reason": openai_finish_reason(finish_reason),
    }
    if finish_reason is not None:
        out["stop_reason"] = stop_reason
    return out


def completion_choice(index: int, text: str, finish_reason: Optional[str],
                      logprobs: Optional[list[TokenLogprob]], want_logprobs: bool,
                      text_offset: int = 0, stop_reason: Any = None) -> dict[str, Any]:
    """One choice of a completions body or chunk (same shape in both)."""
    return {
        "index": index,
        "text": text,
        "logprobs": completion_logprobs(logprobs or [], text_offset) if want_logprobs else None,
        "finish_reason": openai_finish_reason(finish_reason),
        "stop_reason": stop_reason,
    }
