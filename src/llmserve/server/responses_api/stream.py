"""The Responses API's streamed events, made from the chat completion chunks the server sends.

Every event carries its ``type`` and a ``sequence_number`` counting from 0::

    response.created, response.in_progress           (the response, in_progress, no output)
    response.output_item.added      reasoning item   at the first reasoning text (a
    response.reasoning_text.delta ... .done, response.output_item.done     reasoning model)
    response.output_item.added      message item     at the first text
    response.content_part.added     output_text part
    response.output_text.delta      per chunk of text
    response.output_text.done, response.content_part.done, response.output_item.done
                                                     when a tool call starts or the text ends
    response.output_item.added      function_call item (name, call_id, arguments "")
    response.function_call_arguments.delta           the arguments as they arrive
    response.function_call_arguments.done, response.output_item.done
    response.completed | response.incomplete         the whole response, with usage

The response is stored (``store: true``) before its last event is sent, so a client that
reads ``response.completed`` can continue from it at once. An error after the stream
began becomes an ``error`` event followed by ``response.failed``; one before it is raised
as usual (the client gets its status and JSON body). No torch.
"""
from __future__ import annotations

import json
from typing import Any, AsyncIterator, Awaitable, Callable, Optional

from llmserve.server.responses_api.output import (
    ResponseShell,
    finish_status,
    function_call_item,
    message_item,
    reasoning_item,
    usage_of,
)
from llmserve.server.stream.sse import encode_named_event, sse_payloads

#: Makes a response's shell from the first chat chunk's ``id`` and ``created``.
ShellMaker = Callable[[str, Any, str], ResponseShell]
#: Called with the final response object before the last event is sent.
OnComplete = Callable[[dict[str, Any]], Awaitable[None]]


class ResponseStreamTranslator:
    """Chat completion chunks in, Responses events out (one instance per response)."""

    def __init__(self, make_shell: ShellMaker) -> None:
        self.make_shell = make_shell
        self.shell: Optional[ResponseShell] = None
        self.sequence = 0
        self.output: list[dict[str, Any]] = []
        self.open_index: Optional[int] = None          # the output item being streamed
        self.calls: dict[int, int] = {}                 # chat tool-call index -> output index
        self.finish_reason: Optional[str] = None
        self.usage: Optional[dict[str, Any]] = None
        self.final: Optional[dict[str, Any]] = None
        self.done = False

    @property
    def started(self) -> bool:
        return self.shell is not None

    def _event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return encode_named_event(kind, payload)

    def _start(self, chunk: dict[str, Any]) -> list[bytes]:
        self.shell = self.make_shell(str(chunk.get("id", "")), chunk.get("created"),
                                     str(chunk.get("model", "")))
        body = self.shell.body("in_progress", [])
        return [self._event("response.created", response=body),
                self._event("response.in_progress", response=body)]

    def _resp_id(self) -> str:
        return self.shell.resp_id if self.shell is not None else ""

    def _close(self, status: str = "completed") -> list[bytes]:
        """Finish the open output item (its .done events)."""
        if self.open_index is None:
            return []
        index, self.open_index = self.open_index, None
        item = self.output[index]
        item["status"] = status
        out = []
        if item["type"] == "reasoning":
            out.append(self._event("response.reasoning_text.done", item_id=item["id"],
                                   output_index=index, content_index=0,
                                   text=item["content"][0]["text"]))
        elif item["type"] == "message":
            part = item["content"][0]
            out.append(self._event("response.output_text.done", item_id=item["id"],
                                   output_index=index, content_index=0, text=part["text"],
                                   logprobs=[]))
            out.append(self._event("response.content_part.done", item_id=item["id"],
                                   output_index=index, content_index=0, part=dict(part)))
        else:
            out.append(self._event("response.function_call_arguments.done",
                                   item_id=item["id"], output_index=index, name=item["name"],
                                   arguments=item["arguments"]))
        out.append(self._event("response.output_item.done", output_index=index,
                               item=json.loads(json.dumps(item))))
        return out

    def _open(self, item: dict[str, Any]) -> list[bytes]:
        out = self._close()
        self.output.append(item)
        self.open_index = len(self.output) - 1
        added = json.loads(json.dumps(item))
        if item["type"] in ("message", "reasoning"):
            added["content"] = []
        out.append(self._event("response.output_item.added", output_index=self.open_index,
                               item=added))
        if item["type"] == "message":
            out.append(self._event("response.content_part.added", item_id=item["id"],
                                   output_index=self.open_index, content_index=0,
                                   part={"type": "output_text", "text": "",
                                         "annotations": [], "logprobs": []}))
        return out

    def _text(self, text: str) -> list[bytes]:
        out: list[bytes] = []
        if self.open_index is None or self.output[self.open_index]["type"] != "message":
            out += self._open(message_item(self._resp_id(), len(self.output), "",
                                           "in_progress"))
        item = self.output[self.open_index]   # type: ignore[index]
        item["content"][0]["text"] += text
        out.append(self._event("response.output_text.delta", item_id=item["id"],
                               output_index=self.open_index, content_index=0, delta=text,
                               logprobs=[]))
        return out

    def _reasoning(self, text: str) -> list[bytes]:
        out: list[bytes] = []
        if self.open_index is None or self.output[self.open_index]["type"] != "reasoning":
            out += self._open(reasoning_item(self._resp_id(), len(self.output), "",
                                             "in_progress"))
        item = self.output[self.open_index]   # type: ignore[index]
        item["content"][0]["text"] += text
        out.append(self._event("response.reasoning_text.delta", item_id=item["id"],
                               output_index=self.open_index, content_index=0, delta=text))
        return out

    def _call(self, call: dict[str, Any]) -> list[bytes]:
        key = int(call.get("index", 0))
        fn = call.get("function") or {}
        out: list[bytes] = []
        if key not in self.calls:
            out += self._open(function_call_item(
                self._resp_id(), len(self.output), str(call.get("id") or ""),
                str(fn.get("name") or ""), "", "in_progress"))
            self.calls[key] = len(self.output) - 1
        index = self.calls[key]
        delta = fn.get("arguments") or ""
        if delta:
            item = self.output[index]
            item["arguments"] += delta
            out.append(self._event("response.function_call_arguments.delta",
                                   item_id=item["id"], output_index=index, delta=delta))
        return out

    def feed(self, payload: str) -> list[bytes]:
        """The events for one chat SSE payload (a JSON chunk or ``[DONE]``); the last
        ones (after ``[DONE]``) come from :meth:`finish_events`."""
        if self.done or payload.strip() == "[DONE]":
            return []
        chunk = json.loads(payload)
        if "error" in chunk:
            return self.error_events(chunk.get("error") or {})
        out = [] if self.started else self._start(chunk)
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                out += self._reasoning(delta["reasoning_content"])
            if delta.get("content"):
                out += self._text(delta["content"])
            for call in delta.get("tool_calls") or []:
                out += self._call(call)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return out

    def final_response(self) -> dict[str, Any]:
        """The whole response (after the chat stream ended); open items are finished."""
        status, reason = finish_status(self.finish_reason)
        for item in self.output:
            if item["status"] == "in_progress":
                item["status"] = status if item["type"] != "function_call" else "completed"
        if self.shell is None:
            raise RuntimeError("the chat stream ended before its first chunk")
        self.final = self.shell.body(status, self.output, usage_of(self.usage), reason)
        return self.final

    def finish_events(self) -> list[bytes]:
        """Close the open item, then ``response.completed`` (or ``response.incomplete``)."""
        self.done = True
        status, _ = finish_status(self.finish_reason)
        out = self._close(status if self.open_index is not None and
                          self.output[self.open_index]["type"] != "function_call"
                          else "completed")
        final = self.final or self.final_response()
        kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
        out.append(self._event(kind, response=final))
        return out

    def error_events(self, err: dict[str, Any]) -> list[bytes]:
        """``error`` then ``response.failed``: the stream broke after it began."""
        self.done = True
        message = str(err.get("message") or "error")
        code = err.get("code") or err.get("type") or "server_error"
        out = [self._event("error", code=code, message=message, param=err.get("param"))]
        if self.shell is not None:
            body = self.shell.body("failed", self.output, usage_of(self.usage))
            body["error"] = {"code": "server_error", "message": message}
            out.append(self._event("response.failed", response=body))
        return out


async def response_events(chat_events: AsyncIterator[bytes],
                          translator: ResponseStreamTranslator,
                          on_complete: OnComplete) -> AsyncIterator[bytes]:
    """The Responses event stream of a chat completion stream (see the module docstring);
    ``on_complete`` (the store) sees the final response before its last event is sent."""
    finished = False
    payloads = sse_payloads(chat_events)
    try:
        async for payload in payloads:
            finished = payload.strip() == "[DONE]"
            for event in translator.feed(payload):
                yield event
            if finished or translator.done:
                break
    finally:
        await payloads.aclose()
    if translator.started and not translator.done:
        if not finished and translator.finish_reason is None:
            translator.finish_reason = "abort"     # cut short: incomplete
        await on_complete(translator.final_response())
        for event in translator.finish_events():
            yield event
