"""Anthropic Messages responses and errors, made from the chat completion the server ran.

A chat completion's choice becomes a message: its reasoning (``reasoning_content``, from a
reasoning model) a ``thinking`` block (with an empty ``signature``: nothing is signed
here), its text a ``text`` block, each tool call a ``tool_use`` block (arguments parsed back into ``input``); ``finish_reason`` becomes
``stop_reason``::

    stop (a stop string ended it) -> stop_sequence (+ the string)
    stop (end of turn, EOS)       -> end_turn
    length                        -> max_tokens
    tool_calls                    -> tool_use

``usage``: ``input_tokens`` are the prompt tokens computed, ``cache_read_input_tokens``
those the prefix cache supplied (Anthropic's split), ``output_tokens`` the completion's.
Errors keep their HTTP status and take Anthropic's body,
``{"type": "error", "error": {"type", "message"}}``. No torch.
"""
from __future__ import annotations

import json
from typing import Any, Optional

from llmserve.contract.errors import OpenAIError

#: HTTP status -> Anthropic error type.
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 408: "timeout_error",
                409: "invalid_request_error", 413: "request_too_large",
                422: "invalid_request_error", 429: "rate_limit_error",
                503: "overloaded_error", 529: "overloaded_error"}


def anthropic_error_type(status: int) -> str:
    """Anthropic's error ``type`` for an HTTP status."""
    return _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


class AnthropicError(OpenAIError):
    """An error sent in Anthropic's shape (same status, message and headers)."""

    def body(self) -> dict[str, Any]:
        return {"type": "error", "error": {"type": anthropic_error_type(self.status),
                                           "message": self.message}}

    @classmethod
    def of(cls, err: OpenAIError) -> "AnthropicError":
        """The same error, in Anthropic's shape."""
        if isinstance(err, AnthropicError):
            return err
        return cls(err.status, err.message, param=err.param, code=err.code, type=err.type,
                   headers=err.headers)


def error_from_body(status: int, body: Any) -> dict[str, Any]:
    """An OpenAI error body (a stored or relayed one) in Anthropic's shape."""
    err = body.get("error") if isinstance(body, dict) else None
    message = err.get("message") if isinstance(err, dict) else None
    return AnthropicError(status, str(message or "error")).body()


def stop_reason(finish_reason: Optional[str], matched: Any,
                stop_sequences: Optional[list[str]]) -> tuple[Optional[str], Optional[str]]:
    """(stop_reason, stop_sequence) for a choice's ``finish_reason`` and ``stop_reason``."""
    if finish_reason in ("length", "abort"):   # abort: a stored stream that was cut short
        return "max_tokens", None
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "stop":
        if isinstance(matched, str) and matched in (stop_sequences or []):
            return "stop_sequence", matched
        return "end_turn", None
    return None, None


def usage(openai_usage: Optional[dict[str, Any]]) -> dict[str, int]:
    """Anthropic ``usage`` from a chat completion's."""
    u = openai_usage or {}
    cached = int((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return {"input_tokens": int(u.get("prompt_tokens") or 0) - cached,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached,
            "output_tokens": int(u.get("completion_tokens") or 0)}


def message_id(chat_id: str) -> str:
    """``msg_...`` from a ``chatcmpl-...`` id (the same request id after the prefix)."""
    return "msg_" + chat_id.split("-", 1)[-1]


def tool_input(arguments: str) -> dict[str, Any]:
    """A tool call's arguments as the ``input`` object (a non-object is wrapped)."""
    try:
        value = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"value": value}


def message_from_chat(chat: dict[str, Any], model: str,
                      stop_sequences: Optional[list[str]]) -> dict[str, Any]:
    """The Anthropic message of a (non-streamed) chat completion body."""
    choice = chat["choices"][0]
    msg = choice.get("message") or {}
    content: list[dict[str, Any]] = []
    if msg.get("reasoning_content"):     # a reasoning model's think block
        content.append({"type": "thinking", "thinking": msg["reasoning_content"],
                        "signature": ""})
    if msg.get("content"):
        content.append({"type": "text", "text": msg["content"]})
    for call in msg.get("tool_calls") or []:
        fn = call.get("function") or {}
        content.append({"type": "tool_use", "id": call.get("id"), "name": fn.get("name"),
                        "input": tool_input(fn.get("arguments", ""))})
    reason, sequence = stop_reason(choice.get("finish_reason"), choice.get("stop_reason"),
                                   stop_sequences)
    return {"id": message_id(chat.get("id", "")), "type": "message", "role": "assistant",
            "model": model, "content": content, "stop_reason": reason,
            "stop_sequence": sequence, "usage": usage(chat.get("usage"))}
