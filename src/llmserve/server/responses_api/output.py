"""Response objects of the Responses API, made from the chat completion the server ran.

A chat completion's choice becomes a response's ``output``: its reasoning (a reasoning
model's think block, ``reasoning_content``) one ``reasoning`` item (one ``reasoning_text``
part), its text one ``message`` item (one ``output_text`` part), each tool call a
``function_call`` item (``call_id`` the chat call's id). ``finish_reason`` ``length`` makes the response ``incomplete`` with
``incomplete_details.reason`` ``max_output_tokens``; anything else ``completed``.
``usage``: ``input_tokens`` (of which ``cached_tokens`` came from the prefix cache),
``output_tokens``, ``total_tokens``.

A response's id is derived from the chat completion it was made of and the request body,
so an idempotent replay (the gateway answering a retried request from its store) gives
the same response again, id included. No torch.
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Any, Optional

from llmserve.server.responses_api.request import ResponsesRequest


def response_id(tenant: str, chat_id: str, created: Any, body_digest: str) -> str:
    """``resp_<hex>``: one per (tenant, chat completion, request body)."""
    key = f"{tenant}\x00{chat_id}\x00{created}\x00{body_digest}".encode("utf-8")
    return "resp_" + hashlib.sha256(key).hexdigest()[:40]


def body_digest(body: bytes) -> str:
    """The digest of a request body that goes into its response's id."""
    return hashlib.sha256(body).hexdigest()


def item_id(prefix: str, resp_id: str, index: int) -> str:
    """The id of output item ``index`` of response ``resp_id`` (``msg_...``, ``fc_...``)."""
    return f"{prefix}_{resp_id.removeprefix('resp_')}{index:02d}"


def message_item(resp_id: str, index: int, text: str, status: str) -> dict[str, Any]:
    """An assistant ``message`` output item holding ``text``."""
    return {"type": "message", "id": item_id("msg", resp_id, index), "status": status,
            "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [],
                         "logprobs": []}]}


def reasoning_item(resp_id: str, index: int, text: str, status: str) -> dict[str, Any]:
    """A ``reasoning`` output item holding a think block's ``text``."""
    return {"type": "reasoning", "id": item_id("rs", resp_id, index), "status": status,
            "summary": [], "content": [{"type": "reasoning_text", "text": text}]}


def function_call_item(resp_id: str, index: int, call_id: str, name: str, arguments: str,
                       status: str) -> dict[str, Any]:
    """A ``function_call`` output item."""
    return {"type": "function_call", "id": item_id("fc", resp_id, index), "call_id": call_id,
            "name": name, "arguments": arguments, "status": status}


def usage_of(chat_usage: Optional[dict[str, Any]]) -> dict[str, Any]:
    """The Responses ``usage`` of a chat completion's ``usage``."""
    u = chat_usage or {}
    cached = int((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    prompt, completion = int(u.get("prompt_tokens") or 0), int(u.get("completion_tokens") or 0)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": int(
                (u.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0)},
            "total_tokens": prompt + completion}


def response_tools(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's tools as the response shows them (``strict`` filled in)."""
    return [{"type": "function", "name": t.get("name"), "description": t.get("description"),
             "parameters": t.get("parameters"), "strict": t.get("strict", True)}
            for t in req.tools or []]


@dataclass
class ResponseShell:
    """What every state of one response shares: its id, creation time, model and request."""

    resp_id: str
    created_at: int
    model: str
    req: ResponsesRequest

    def body(self, status: str, output: list[dict[str, Any]],
             usage: Optional[dict[str, Any]] = None,
             incomplete_reason: Optional[str] = None) -> dict[str, Any]:
        """The response object in ``status`` (in_progress, completed, incomplete)."""
        req = self.req
        fmt = req.text.format if req.text is not None else None
        text: dict[str, Any] = {"format": {"type": "text"}}
        if fmt is not None:
            text["format"] = {k: v for k, v in fmt.model_dump(by_alias=True).items()
                              if v is not None}
        if req.text is not None and req.text.verbosity:
            text["verbosity"] = req.text.verbosity
        choice = req.tool_choice if req.tool_choice is not None else "auto"
        return {
            "id": self.resp_id, "object": "response", "created_at": self.created_at,
            "status": status,
            "completed_at": int(time.time()) if status in ("completed", "incomplete") else None,
            "background": False, "error": None,
            "incomplete_details": {"reason": incomplete_reason} if incomplete_reason else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "metadata": dict(req.metadata or {}), "model": self.model, "output": output,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": req.reasoning.effort if req.reasoning else None,
                          "summary": req.reasoning.summary if req.reasoning else None},
            "store": req.store, "temperature": req.temperature, "text": text,
            "tool_choice": choice, "tools": response_tools(req), "top_p": req.top_p,
            "truncation": req.truncation or "disabled", "usage": usage,
            "user": req.user, "service_tier": req.service_tier or "default",
        }


def output_of_message(resp_id: str, message: dict[str, Any], status: str
                      ) -> list[dict[str, Any]]:
    """The output items of a chat choice's ``message``: reasoning, text, then the calls."""
    items: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        items.append(reasoning_item(resp_id, 0, message["reasoning_content"], status))
    if message.get("content"):
        items.append(message_item(resp_id, len(items), message["content"], status))
    for call in message.get("tool_calls") or []:
        fn = call.get("function") or {}
        items.append(function_call_item(resp_id, len(items), str(call.get("id", "")),
                                        str(fn.get("name", "")),
                                        str(fn.get("arguments", "")), "completed"))
    return items


def finish_status(finish_reason: Optional[str]) -> tuple[str, Optional[str]]:
    """(status, incomplete reason) of a chat choice's ``finish_reason``."""
    if finish_reason in ("length", "abort"):
        return "incomplete", "max_output_tokens"
    return "completed", None


def response_from_chat(chat: dict[str, Any], shell: ResponseShell) -> dict[str, Any]:
    """The response object of a (non-streamed) chat completion body."""
    choice = chat["choices"][0]
    status, reason = finish_status(choice.get("finish_reason"))
    output = output_of_message(shell.resp_id, choice.get("message") or {}, status)
    return shell.body(status, output, usage_of(chat.get("usage")), reason)


def conversation_of(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages a response's output adds to its conversation (for a later
    ``previous_response_id``): one assistant message with its text and tool calls (the
    reasoning is left out, as chat templates drop it from earlier turns)."""
    text = "".join(part.get("text", "") for item in output if item["type"] == "message"
                   for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    if not text and not calls:
        return [{"role": "assistant", "content": ""}]
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    return [message]
