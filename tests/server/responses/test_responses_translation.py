"""Responses requests -> chat bodies, chat chunks -> Responses events, and the SQLite store
(no server)."""
from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator

import pytest

from llmserve.contract.errors import OpenAIError
from llmserve.server.responses_api.output import ResponseShell, conversation_of, response_from_chat
from llmserve.server.responses_api.request import ResponsesRequest, chat_body, input_messages
from llmserve.server.responses_api.store import ResponseStore, StoredResponse
from llmserve.server.responses_api.stream import ResponseStreamTranslator, response_events


def _req(**kw: Any) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"input": "hi", **kw})


def test_input_items_become_chat_messages():
    items = [
        {"role": "developer", "content": "Be terse."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                         {"type": "input_text", "text": "b"}]},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "calling"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{\"x\":1}"},
        {"type": "reasoning", "summary": []},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2",
         "output": [{"type": "input_text", "text": "two"}]},
    ]
    assert input_messages(items) == [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "calling", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "g",
                                                          "arguments": "{\"x\":1}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
    ]
    with pytest.raises(OpenAIError) as bad:
        input_messages([{"type": "function_call", "name": "f", "arguments": "{}"}])
    assert bad.value.param == "input[0].call_id"


def test_the_chat_body_carries_every_setting():
    req = _req(model="m", instructions="Sys", max_output_tokens=7, temperature=0.5, top_p=0.9,
               user="u", parallel_tool_calls=False, stream=True,
               tools=[{"type": "function", "name": "f", "parameters": {"type": "object"}}],
               tool_choice={"type": "function", "name": "f"},
               text={"format": {"type": "json_schema", "name": "s", "schema": {"type": "object"},
                                "strict": True}})
    history = [{"role": "user", "content": "before"}, {"role": "assistant", "content": "ok"}]
    body = chat_body(req, history, input_messages(req.input))
    assert body == {
        "model": "m",
        "messages": [{"role": "system", "content": "Sys"}, *history,
                     {"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": "f",
                                                    "parameters": {"type": "object"}}}],
        "tool_choice": {"type": "function", "function": {"name": "f"}},
        "parallel_tool_calls": False, "max_tokens": 7, "temperature": 0.5, "top_p": 0.9,
        "user": "u", "stream": True, "stream_options": {"include_usage": True},
        "response_format": {"type": "json_schema", "json_schema": {
            "name": "s", "schema": {"type": "object"}, "strict": True}},
    }
    with pytest.raises(OpenAIError) as bad:
        chat_body(_req(text={"format": {"type": "json_schema", "schema": {}}}), [], [])
    assert bad.value.param == "text.format"


def _shell(**kw: Any) -> ResponseShell:
    return ResponseShell("resp_abc", 1, "m", _req(**kw))


def test_a_chat_completion_becomes_a_response_and_a_conversation_turn():
    chat = {"id": "chatcmpl-1", "created": 1, "model": "m", "choices": [{
        "index": 0, "finish_reason": "tool_calls", "message": {
            "role": "assistant", "content": "Let me add.", "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "add", "arguments": "{\"a\":1}"}}]}}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15,
                  "prompt_tokens_details": {"cached_tokens": 4}}}
    resp = response_from_chat(chat, _shell())
    assert resp["status"] == "completed" and resp["incomplete_details"] is None
    assert [o["type"] for o in resp["output"]] == ["message", "function_call"]
    assert resp["output"][1]["call_id"] == "call_1"
    assert resp["usage"] == {"input_tokens": 10, "input_tokens_details": {"cached_tokens": 4},
                             "output_tokens": 5, "output_tokens_details": {"reasoning_tokens": 0},
                             "total_tokens": 15}
    assert conversation_of(resp["output"]) == [
        {"role": "assistant", "content": "Let me add.",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "add", "arguments": "{\"a\":1}"}}]}]
    chat["choices"][0]["finish_reason"] = "length"
    cut = response_from_chat(chat, _shell())
    assert cut["status"] == "incomplete"
    assert cut["incomplete_details"] == {"reason": "max_output_tokens"}


def _chunk(delta: dict[str, Any], finish: Any = None, **extra: Any) -> str:
    return json.dumps({"id": "chatcmpl-1", "created": 1, "model": "m",
                       "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
                       **extra})


def _decode(events: list[bytes]) -> list[dict[str, Any]]:
    out = []
    for raw in events:
        kind, data = raw.decode().strip().split("\n")
        payload = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {payload['type']}"
        out.append(payload)
    return out


async def _stream(payloads: list[str]) -> AsyncIterator[bytes]:
    for p in payloads:
        yield f"data: {p}\n\n".encode()


def test_the_stream_opens_and_closes_items_in_order_and_stores_first():
    payloads = [
        _chunk({"role": "assistant", "content": ""}),
        _chunk({"content": "Hel"}), _chunk({"content": "lo"}),
        _chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                "function": {"name": "f", "arguments": ""}}]}),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": "{\"a\":"}}]}),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}),
        _chunk({}, "tool_calls"),
        json.dumps({"id": "chatcmpl-1", "created": 1, "model": "m", "choices": [],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}}),
        "[DONE]",
    ]
    stored: list[dict[str, Any]] = []

    async def keep(final: dict[str, Any]) -> None:
        stored.append(final)

    async def run() -> list[bytes]:
        translator = ResponseStreamTranslator(lambda cid, created, model: _shell())
        return [e async for e in response_events(_stream(payloads), translator, keep)]

    events = _decode(asyncio.run(run()))
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[6]["text"] == "Hello" and events[12]["arguments"] == "{\"a\":1}"
    final = events[-1]["response"]
    assert stored == [final] and final["usage"]["output_tokens"] == 4
    assert [o["status"] for o in final["output"]] == ["completed", "completed"]
    assert events[2]["item"]["content"] == [] and events[9]["item"]["arguments"] == ""


def test_an_error_mid_stream_is_an_error_then_failed():
    payloads = [_chunk({"role": "assistant", "content": ""}), _chunk({"content": "x"}),
                json.dumps({"error": {"message": "boom", "type": "server_error",
                                      "code": "internal_error"}}), "[DONE]"]
    kept: list[Any] = []

    async def keep(final: dict[str, Any]) -> None:
        kept.append(final)

    async def run() -> list[bytes]:
        translator = ResponseStreamTranslator(lambda cid, created, model: _shell())
        return [e async for e in response_events(_stream(payloads), translator, keep)]

    events = _decode(asyncio.run(run()))
    assert [e["type"] for e in events][-2:] == ["error", "response.failed"]
    assert events[-2]["message"] == "boom" and events[-1]["response"]["status"] == "failed"
    assert kept == []


def test_the_store_is_per_tenant_and_expires(tmp_path):
    store = ResponseStore(str(tmp_path / "r.db"), ttl_s=60)
    record = StoredResponse({"id": "resp_1", "output": []}, [{"id": "msg_1"}],
                            [{"role": "user", "content": "hi"}])
    store.put("a", record, now=1000.0)
    assert store.get("a", "resp_1", now=1001.0) == record
    assert store.get("b", "resp_1", now=1001.0) is None
    assert store.get("a", "resp_1", now=1061.0) is None          # expired
    store.put("a", StoredResponse({"id": "resp_2"}, [], []), now=2000.0)
    assert store.count() == 1                                     # the expired row purged
    assert not store.delete("b", "resp_2") and store.delete("a", "resp_2")
    store.close()
    reopened = ResponseStore(str(tmp_path / "r.db"))
    assert reopened.count() == 0
    with pytest.raises(ValueError):
        ResponseStore(":memory:", ttl_s=0)
    with pytest.raises(ValueError, match="cannot open"):
        ResponseStore(str(tmp_path / "no" / "such" / "dir.db"))


def test_reasoning_becomes_a_reasoning_item_first_whole_and_streamed():
    chat = {"id": "chatcmpl-1", "created": 1, "model": "m", "choices": [{
        "index": 0, "finish_reason": "stop", "message": {
            "role": "assistant", "reasoning_content": "Think.", "content": "Done."}}],
        "usage": {"prompt_tokens": 2, "completion_tokens": 5, "total_tokens": 7}}
    resp = response_from_chat(chat, _shell())
    assert [o["type"] for o in resp["output"]] == ["reasoning", "message"]
    assert resp["output"][0]["content"] == [{"type": "reasoning_text", "text": "Think."}]
    assert conversation_of(resp["output"]) == [{"role": "assistant", "content": "Done."}]
    payloads = [_chunk({"role": "assistant", "content": ""}),
                _chunk({"reasoning_content": "Thi"}), _chunk({"reasoning_content": "nk."}),
                _chunk({"content": "Done."}), _chunk({}, "stop"), "[DONE]"]

    async def keep(final: dict[str, Any]) -> None:
        return None

    async def run() -> list[bytes]:
        translator = ResponseStreamTranslator(lambda cid, created, model: _shell())
        return [e async for e in response_events(_stream(payloads), translator, keep)]

    events = _decode(asyncio.run(run()))
    kinds = [e["type"] for e in events]
    assert kinds[2:7] == ["response.output_item.added", "response.reasoning_text.delta",
                          "response.reasoning_text.delta", "response.reasoning_text.done",
                          "response.output_item.done"]
    assert events[5]["text"] == "Think." and events[2]["item"]["type"] == "reasoning"
    final = events[-1]["response"]
    assert [o["type"] for o in final["output"]] == ["reasoning", "message"]
    assert final["output"][1]["content"][0]["text"] == "Done."
