"""Anthropic's streamed event sequence, made from the chat completion chunks the server sends.

One message, its content blocks opened and closed in order::

    message_start                      (id, model; usage so far: 0 tokens)
    content_block_start                thinking block, at the first reasoning text
    content_block_delta  thinking_delta  per chunk of reasoning (a reasoning model)
    content_block_start  index 0       text block, at the first text
    content_block_delta  text_delta    per chunk of text
    content_block_stop   index 0       when a tool call starts or the message ends
    content_block_start  index 1       tool_use block (id, name, input {})
    content_block_delta  input_json_delta  the call's arguments as they arrive
    content_block_stop   index 1
    message_delta                      stop_reason, stop_sequence, usage
    message_stop

An error after the stream began becomes an ``error`` event (Anthropic's shape) and ends
the stream; one before it (nothing was sent yet) is raised as :class:`AnthropicError`, so
the client gets the status and an Anthropic error body. No torch.
"""
from __future__ import annotations

import json
from typing import Any, AsyncIterator, Optional

from llmserve.contract.errors import OpenAIError
from llmserve.server.anthropic.response import (
    AnthropicError,
    anthropic_error_type,
    message_id,
    stop_reason,
    usage,
)
from llmserve.server.stream.sse import encode_named_event as sse
from llmserve.server.stream.sse import sse_payloads


class MessageStreamTranslator:
    """Chat completion chunks in, Anthropic events out (one instance per response)."""

    def __init__(self, model: str, stop_sequences: Optional[list[str]]) -> None:
        self.model = model
        self.stop_sequences = stop_sequences
        self.started = False
        self.index = -1                 # the open content block, -1 when none
        self.open_kind: Optional[str] = None
        self.tool_calls_seen: set[int] = set()   # chat tool-call indexes given a block
        self.finish: tuple[Optional[str], Optional[str]] = (None, None)
        self.usage: Optional[dict[str, Any]] = None
        self.done = False

    def _start(self, chunk: dict[str, Any]) -> list[bytes]:
        self.started = True
        return [sse("message_start", {"type": "message_start", "message": {
            "id": message_id(chunk.get("id", "")), "type": "message", "role": "assistant",
            "model": self.model, "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0}}})]

    def _close(self) -> list[bytes]:
        if self.open_kind is None:
            return []
        self.open_kind = None
        return [sse("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _open(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        out = self._close()
        self.index += 1
        self.open_kind = kind
        out.append(sse("content_block_start", {"type": "content_block_start",
                                               "index": self.index, "content_block": block}))
        return out

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return sse("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                           "delta": delta})

    def feed(self, payload: str) -> list[bytes]:
        """The Anthropic events for one chat SSE payload (a JSON chunk or ``[DONE]``)."""
        if self.done:
            return []
        if payload.strip() == "[DONE]":
            return self.finish_events()
        chunk = json.loads(payload)
        if "error" in chunk:
            self.done = True
            err = chunk["error"] or {}
            status = 500 if err.get("type") == "server_error" else 400
            return [sse("error", {"type": "error", "error": {
                "type": anthropic_error_type(status), "message": err.get("message", "error")}})]
        out = [] if self.started else self._start(chunk)
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                if self.open_kind != "thinking":
                    out += self._open("thinking", {"type": "thinking", "thinking": "",
                                                   "signature": ""})
                out.append(self._delta({"type": "thinking_delta",
                                        "thinking": delta["reasoning_content"]}))
            if delta.get("content"):
                if self.open_kind != "text":
                    out += self._open("text", {"type": "text", "text": ""})
                out.append(self._delta({"type": "text_delta", "text": delta["content"]}))
            for call in delta.get("tool_calls") or []:
                key = int(call.get("index", 0))
                fn = call.get("function") or {}
                if key not in self.tool_calls_seen:
                    out += self._open("tool_use", {"type": "tool_use", "id": call.get("id"),
                                                   "name": fn.get("name"), "input": {}})
                    self.tool_calls_seen.add(key)
                if fn.get("arguments"):
                    out.append(self._delta({"type": "input_json_delta",
                                            "partial_json": fn["arguments"]}))
            if choice.get("finish_reason"):
                self.finish = stop_reason(choice["finish_reason"], choice.get("stop_reason"),
                                          self.stop_sequences)
        return out

    def finish_events(self) -> list[bytes]:
        """Close the open block, then ``message_delta`` and ``message_stop``."""
        self.done = True
        out = self._close()
        reason, sequence = self.finish
        counted = usage(self.usage)
        out.append(sse("message_delta", {"type": "message_delta",
                                         "delta": {"stop_reason": reason,
                                                   "stop_sequence": sequence},
                                         "usage": counted}))
        out.append(sse("message_stop", {"type": "message_stop"}))
        return out


async def anthropic_events(chat_events: AsyncIterator[bytes], model: str,
                           stop_sequences: Optional[list[str]]) -> AsyncIterator[bytes]:
    """The Anthropic event stream of a chat completion stream (see the module docstring)."""
    translator = MessageStreamTranslator(model, stop_sequences)
    payloads = sse_payloads(chat_events)
    try:
        async for payload in payloads:
            for event in translator.feed(payload):
                yield event
            if translator.done:
                break
    except OpenAIError as err:   # before anything was sent: a plain error response
        raise AnthropicError.of(err) from None
    finally:
        await payloads.aclose()
    if translator.started and not translator.done:   # ended without [DONE]
        for event in translator.finish_events():
            yield event
