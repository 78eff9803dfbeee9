"""Messages <-> chat completion translation, without a server: request bodies, messages,
stop reasons, usage, and the event sequence made from chat chunks."""
from __future__ import annotations

import json

import pytest

from llmserve.contract.errors import OpenAIError
from llmserve.server.anthropic.request import MessagesRequest, chat_body
from llmserve.server.anthropic.response import AnthropicError, message_from_chat
from llmserve.server.anthropic.stream import MessageStreamTranslator

TOOL = {"name": "add", "description": "Add", "input_schema": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}


def _req(**kw):
    base = {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}
    return MessagesRequest.model_validate({**base, **kw})


def test_a_tool_conversation_becomes_the_chat_messages_in_order():
    body = chat_body(_req(
        system=[{"type": "text", "text": "Be brief."}],
        messages=[
            {"role": "user", "content": "Add 2"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "...", "signature": "s"},
                {"type": "text", "text": "Calling."},
                {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {"a": 2}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "2"},
                {"type": "text", "text": "Thanks"}]}],
        tools=[TOOL], tool_choice={"type": "any", "disable_parallel_tool_use": True},
        stop_sequences=["\n\n"], temperature=0.5, top_k=5, metadata={"user_id": "u1"},
        stream=True))
    assert [m["role"] for m in body["messages"]] == ["system", "user", "assistant", "tool",
                                                     "user"]
    call = body["messages"][2]["tool_calls"][0]
    assert call["id"] == "toolu_1" and json.loads(call["function"]["arguments"]) == {"a": 2}
    assert body["messages"][2]["content"] == "Calling."
    assert body["messages"][3] == {"role": "tool", "tool_call_id": "toolu_1", "content": "2"}
    assert body["tools"][0]["function"]["parameters"] == TOOL["input_schema"]
    assert body["tool_choice"] == "required" and body["parallel_tool_calls"] is False
    assert body["stop"] == ["\n\n"] and body["top_k"] == 5 and body["user"] == "u1"
    assert body["stream_options"] == {"include_usage": True}
    named = chat_body(_req(tools=[TOOL], tool_choice={"type": "tool", "name": "add"}))
    assert named["tool_choice"] == {"type": "function", "function": {"name": "add"}}


@pytest.mark.parametrize("kw, where", [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages[0].content[0].type"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking.type"),
    ({"tool_choice": {"type": "tool"}, "tools": [TOOL]}, "tool_choice.name"),
    ({"messages": [{"role": "assistant", "content": [
        {"type": "tool_result", "tool_use_id": "x", "content": "y"}]},
        {"role": "user", "content": "z"}]}, "messages[0].content"),
])
def test_what_cannot_be_served_is_a_400_naming_the_field(kw, where):
    with pytest.raises(OpenAIError) as info:
        chat_body(_req(**kw))
    assert info.value.status == 400 and info.value.param == where


@pytest.mark.parametrize("messages, where", [
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer is"}],
     "messages[1]"),
    ([{"role": "user", "content": []}], "messages[0].content"),
    ([{"role": "user", "content": ""}], "messages[0].content"),
    ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content[0].text"),
])
def test_a_prefill_and_empty_or_malformed_content_are_400s(messages, where):
    with pytest.raises(OpenAIError) as info:
        chat_body(_req(messages=messages))
    assert info.value.status == 400 and info.value.param == where
    assert "pydantic" not in info.value.message


def test_an_assistant_turn_of_only_thinking_is_left_out():
    body = chat_body(_req(messages=[
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "...",
                                           "signature": "s"}]},
        {"role": "user", "content": "b"}]))
    assert [m["role"] for m in body["messages"]] == ["user", "user"]


def test_unknown_fields_and_a_missing_max_tokens_are_refused():
    with pytest.raises(ValueError):
        MessagesRequest.model_validate({"model": "m", "messages": [{"role": "user",
                                                                   "content": "x"}]})
    with pytest.raises(ValueError):
        _req(container="c1")


def test_a_chat_completion_becomes_a_message():
    chat = {"id": "chatcmpl-abc", "choices": [{"index": 0, "finish_reason": "stop",
                                               "stop_reason": "END", "message": {
                                                   "role": "assistant", "content": "Hello"}}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 3,
                      "prompt_tokens_details": {"cached_tokens": 4}}}
    msg = message_from_chat(chat, "m", ["END"])
    assert msg["id"] == "msg_abc" and msg["content"] == [{"type": "text", "text": "Hello"}]
    assert (msg["stop_reason"], msg["stop_sequence"]) == ("stop_sequence", "END")
    assert msg["usage"] == {"input_tokens": 6, "cache_creation_input_tokens": 0,
                            "cache_read_input_tokens": 4, "output_tokens": 3}
    chat["choices"][0].update(finish_reason="tool_calls", message={
        "role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add",
                                                              "arguments": '{"a": 1}'}}]})
    msg = message_from_chat(chat, "m", None)
    assert msg["stop_reason"] == "tool_use"
    assert msg["content"] == [{"type": "tool_use", "id": "call_1", "name": "add",
                               "input": {"a": 1}}]
    chat["choices"][0].update(finish_reason="length", message={"content": "x"})
    assert message_from_chat(chat, "m", None)["stop_reason"] == "max_tokens"


def test_errors_keep_their_status_and_take_anthropics_shape():
    err = AnthropicError.of(OpenAIError(429, "slow down", headers={"Retry-After": "2"}))
    assert err.status == 429 and err.headers == {"Retry-After": "2"}
    assert err.body() == {"type": "error", "error": {"type": "rate_limit_error",
                                                     "message": "slow down"}}
    assert AnthropicError(401, "x").body()["error"]["type"] == "authentication_error"
    assert AnthropicError(503, "x").body()["error"]["type"] == "overloaded_error"


def _events(raws):
    t = MessageStreamTranslator("m", ["STOP"])
    out = []
    for payload in raws:
        for e in t.feed(payload):
            kind, data = e.decode().split("\n", 1)
            out.append((kind[len("event: "):], json.loads(data[len("data: "):])))
    return out


def test_chat_chunks_become_anthropics_event_sequence():
    chunk = lambda delta, fin=None, **kw: json.dumps(  # noqa: E731
        {"id": "chatcmpl-z", "choices": [{"index": 0, "delta": delta, "finish_reason": fin,
                                          **kw}]})
    events = _events([
        chunk({"role": "assistant", "content": ""}), chunk({"content": "Let me "}),
        chunk({"content": "add."}),
        chunk({"tool_calls": [{"index": 0, "id": "call_9", "type": "function",
                               "function": {"name": "add", "arguments": ""}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"a": 4}'}}]}),
        chunk({}, "tool_calls"),
        json.dumps({"id": "chatcmpl-z", "choices": [], "usage": {
            "prompt_tokens": 7, "completion_tokens": 5}}),
        "[DONE]"])
    kinds = [k for k, _ in events]
    assert kinds == ["message_start", "content_block_start", "content_block_delta",
                     "content_block_delta", "content_block_stop", "content_block_start",
                     "content_block_delta", "content_block_stop", "message_delta",
                     "message_stop"]
    assert events[0][1]["message"]["id"] == "msg_z"
    assert events[1][1]["content_block"] == {"type": "text", "text": ""}
    assert events[5][1] == {"type": "content_block_start", "index": 1, "content_block": {
        "type": "tool_use", "id": "call_9", "name": "add", "input": {}}}
    assert events[6][1]["delta"] == {"type": "input_json_delta", "partial_json": '{"a": 4}'}
    assert events[8][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert events[8][1]["usage"]["output_tokens"] == 5


def test_a_stop_sequence_and_an_error_mid_stream():
    ok = _events([json.dumps({"id": "c-1", "choices": [{"index": 0, "delta": {
        "content": "a"}, "finish_reason": "stop", "stop_reason": "STOP"}]}), "[DONE]"])
    assert ok[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "STOP"}
    bad = _events([json.dumps({"id": "c-1", "choices": [{"index": 0, "delta": {
        "content": "a"}}]}), json.dumps({"error": {"message": "boom", "type": "server_error"}}),
        "[DONE]"])
    assert bad[-1] == ("error", {"type": "error", "error": {"type": "api_error",
                                                           "message": "boom"}})


def test_reasoning_becomes_a_thinking_block_first():
    chunk = lambda delta, fin=None: json.dumps(  # noqa: E731
        {"id": "chatcmpl-r", "choices": [{"index": 0, "delta": delta, "finish_reason": fin}]})
    events = _events([chunk({"role": "assistant", "content": ""}),
                      chunk({"reasoning_content": "Hmm, "}), chunk({"reasoning_content": "4."}),
                      chunk({"content": "Four."}), chunk({}, "stop"), "[DONE]"])
    assert [k for k, _ in events][1:8] == [
        "content_block_start", "content_block_delta", "content_block_delta",
        "content_block_stop", "content_block_start", "content_block_delta",
        "content_block_stop"]
    assert events[1][1]["content_block"] == {"type": "thinking", "thinking": "",
                                             "signature": ""}
    assert events[2][1]["delta"] == {"type": "thinking_delta", "thinking": "Hmm, "}
    assert events[5][1]["index"] == 1 and events[5][1]["content_block"]["type"] == "text"
    message = message_from_chat({"id": "chatcmpl-r", "choices": [{
        "finish_reason": "stop", "message": {"reasoning_content": "Hmm.", "content": "Four."}}]},
        "m", None)
    assert [b["type"] for b in message["content"]] == ["thinking", "text"]
    assert message["content"][0]["thinking"] == "Hmm."


def test_streamed_argument_pieces_become_one_input_json_delta_each():
    """Tool-call arguments streamed as they are generated (llmserve.tool_parsers) arrive
    as input_json_delta events, one per chat delta, adding up to each call's input."""
    from llmserve.tool_parsers import PARSERS

    tools = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
    text = ('<tool_call>\n{"name": "add", "arguments": {"a": 4, "b": "x{y"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "add", "arguments": {"a": 5}}\n</tool_call>')
    streamer = PARSERS["hermes"].streamer(tools)
    payloads = [json.dumps({"id": "chatcmpl-z", "choices": [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})]
    num_arg_deltas = 0
    for i in range(0, len(text), 4):
        _, deltas = streamer.feed(text[i:i + 4])
        num_arg_deltas += sum(1 for d in deltas if d["function"].get("arguments"))
        payloads += [json.dumps({"id": "chatcmpl-z", "choices": [
            {"index": 0, "delta": {"tool_calls": [d]}, "finish_reason": None}]})
            for d in deltas]
    payloads += [json.dumps({"id": "chatcmpl-z", "choices": [
        {"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}), "[DONE]"]
    events = _events(payloads)
    starts = [e for k, e in events if k == "content_block_start"]
    assert [s["content_block"]["name"] for s in starts] == ["add", "add"]
    pieces = [e for k, e in events if k == "content_block_delta"]
    assert len(pieces) == num_arg_deltas > 4
    assert all(p["delta"]["type"] == "input_json_delta" for p in pieces)
    inputs = ["".join(p["delta"]["partial_json"] for p in pieces if p["index"] == i)
              for i in (0, 1)]
    assert [json.loads(x) for x in inputs] == [{"a": 4, "b": "x{y"}, {"a": 5}]
