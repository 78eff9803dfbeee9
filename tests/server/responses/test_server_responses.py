"""/v1/responses over a real HTTP server with the official `openai` SDK as the client
(fake and real engine): plain and streamed answers, function tools, previous_response_id,
the store's read endpoints, tenants under a gateway, and clear 400s."""
from __future__ import annotations

import json
from typing import Callable

import httpx
import openai
import pytest

from llmserve.contract.errors import OpenAIError
from llmserve.contract.gateway_hook import Gateway, RequestContext
from tests.server.conftest import LiveServer
from tests.server.server_fakes import FakeEngine

ADD = {"type": "function", "name": "add", "description": "Add two integers",
       "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                       "b": {"type": "integer"}},
                      "required": ["a", "b"], "additionalProperties": False}}
ASK = "What is 2 + 3? Answer briefly."


def _client(server: LiveServer, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url("/v1"), api_key=key, max_retries=0)


def _model(server: LiveServer) -> str:
    return httpx.get(server.url("/v1/models"), timeout=10).json()["data"][0]["id"]


def _needs_a_model(server: LiveServer) -> None:
    if isinstance(server.engine, FakeEngine):
        pytest.skip("the fake engine enforces no grammar")


def test_create_retrieve_and_stream_the_same_response(server):
    client, model = _client(server), _model(server)
    resp = client.responses.create(model=model, input=ASK, instructions="Be brief.",
                                   max_output_tokens=8, temperature=0)
    assert resp.object == "response" and resp.id.startswith("resp_")
    assert resp.status in ("completed", "incomplete") and resp.output_text
    assert resp.output[0].type == "message" and resp.output[0].role == "assistant"
    assert resp.usage.output_tokens >= 1 and resp.usage.input_tokens > 0
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens
    if resp.status == "incomplete":
        assert resp.incomplete_details.reason == "max_output_tokens"
    assert resp.instructions == "Be brief." and resp.store is True
    again = client.responses.retrieve(resp.id)
    assert again.id == resp.id and again.output_text == resp.output_text
    items = client.responses.input_items.list(resp.id)
    assert [i.type for i in items.data] == ["message"]
    assert items.data[0].content[0].text == ASK

    events = list(client.responses.create(model=model, input=ASK, instructions="Be brief.",
                                          max_output_tokens=8, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done",
                          "response.completed" if resp.status == "completed"
                          else "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text == resp.output_text == final.output_text
    assert final.usage.output_tokens == resp.usage.output_tokens
    assert final.id != resp.id and client.responses.retrieve(final.id).output_text == text


def test_store_false_keeps_nothing_and_delete_removes(server):
    client, model = _client(server), _model(server)
    resp = client.responses.create(model=model, input=ASK, max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(resp.id)
    kept = client.responses.create(model=model, input=ASK, max_output_tokens=2)
    client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(model=model, input="And then?", previous_response_id=kept.id)
    assert missing.value.body["param"] == "previous_response_id"


def test_previous_response_id_continues_the_conversation(server):
    client, model = _client(server), _model(server)
    first = client.responses.create(model=model, input=ASK, max_output_tokens=6,
                                    temperature=0)
    follow = client.responses.create(model=model, input="Say it again.", max_output_tokens=6,
                                     temperature=0, previous_response_id=first.id)
    assert follow.previous_response_id == first.id
    assert follow.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    # the same conversation written out by hand costs the same prompt
    by_hand = client.responses.create(model=model, max_output_tokens=6, temperature=0, input=[
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Say it again."}])
    assert by_hand.usage.input_tokens == follow.usage.input_tokens
    assert by_hand.output_text == follow.output_text


def test_a_forced_function_call_streamed_and_not_and_its_output(server):
    _needs_a_model(server)
    client, model = _client(server), _model(server)
    resp = client.responses.create(model=model, input=ASK, tools=[ADD], temperature=0,
                                   tool_choice={"type": "function", "name": "add"},
                                   max_output_tokens=64)
    calls = [o for o in resp.output if o.type == "function_call"]
    assert calls and calls[0].name == "add" and calls[0].call_id
    args = json.loads(calls[0].arguments)
    assert set(args) == {"a", "b"} and all(isinstance(v, int) for v in args.values())
    events = list(client.responses.create(model=model, input=ASK, tools=[ADD], temperature=0,
                                          tool_choice={"type": "function", "name": "add"},
                                          max_output_tokens=64, stream=True))
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds
    assert kinds.index("response.function_call_arguments.done") \
        < kinds.index("response.completed")
    streamed: dict[int, str] = {}
    for e in events:
        if e.type == "response.function_call_arguments.delta":
            streamed[e.output_index] = streamed.get(e.output_index, "") + e.delta
    assert list(streamed.values()) == [c.arguments for c in calls]
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [(i.name, i.arguments) for i in done] == [(c.name, c.arguments) for c in calls]
    # the call's result, fed back through previous_response_id
    answer = client.responses.create(model=model, tools=[ADD], temperature=0,
                                     max_output_tokens=8, previous_response_id=resp.id,
                                     input=[{"type": "function_call_output",
                                             "call_id": calls[0].call_id, "output": "5"}])
    assert answer.status in ("completed", "incomplete") and answer.usage.input_tokens \
        > resp.usage.input_tokens


def test_text_format_json_schema_is_enforced(server):
    _needs_a_model(server)
    client, model = _client(server), _model(server)
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}},
              "required": ["answer"], "additionalProperties": False}
    resp = client.responses.create(model=model, input=ASK, temperature=0, max_output_tokens=32,
                                   text={"format": {"type": "json_schema", "name": "sum",
                                                    "schema": schema, "strict": True}})
    value = json.loads(resp.output_text)
    assert set(value) == {"answer"} and isinstance(value["answer"], int)
    assert resp.text.format.type == "json_schema"


def test_what_is_not_supported_is_a_clear_400(server):
    client, model = _client(server), _model(server)
    cases = [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"background": True}, "background"),
        ({"truncation": "auto"}, "truncation"),
        ({"input": [{"role": "user", "content": [{"type": "input_image",
                                                  "image_url": "http://x/y.png"}]}]},
         "input[0].content[0].type"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        ({"include": ["file_search_call.results"]}, "include"),
        ({"tool_choice": {"type": "file_search"}}, "tool_choice"),
    ]
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as bad:
            client.responses.create(**{"model": model, "input": ASK, **extra})
        assert bad.value.body["param"] == param, extra
    raw = httpx.post(server.url("/v1/responses"), json={"model": model, "input": ASK,
                                                        "frobnicate": 1}, timeout=10)
    assert raw.status_code == 400 and "frobnicate" in raw.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="no-such-model", input=ASK)
    assert client.responses.create(model=model, input=ASK, max_output_tokens=2).output_text


class TenantGateway(Gateway):
    """Bearer keys -> tenants (what the gateway's auth does)."""

    KEYS = {"Bearer sk-a": "a", "Bearer sk-b": "b"}

    def __init__(self) -> None:
        self.endpoints: list[str] = []

    async def authenticate(self, ctx: RequestContext) -> None:
        tenant = self.KEYS.get(ctx.headers.get("authorization", ""))
        if tenant is None:
            raise OpenAIError(401, "Missing or invalid API key", code="invalid_api_key")
        ctx.tenant = tenant
        self.endpoints.append(ctx.endpoint)


def test_stored_responses_belong_to_their_tenant(start_server: Callable[..., LiveServer]):
    gw = TenantGateway()
    live = start_server(FakeEngine(), gateway=gw)
    a, b = _client(live, "sk-a"), _client(live, "sk-b")
    resp = a.responses.create(model="fake-model", input=ASK, max_output_tokens=4)
    assert gw.endpoints == ["responses", "chat.completions"]
    assert a.responses.retrieve(resp.id).id == resp.id
    for call in (lambda: b.responses.retrieve(resp.id), lambda: b.responses.delete(resp.id),
                 lambda: b.responses.create(model="fake-model", input="more",
                                            previous_response_id=resp.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    with pytest.raises(openai.AuthenticationError):
        _client(live, "sk-bad").responses.retrieve(resp.id)
    raw = httpx.post(live.url("/v1/responses"), content=b"{not json", timeout=10)
    assert raw.status_code == 401     # the key is checked before the body is read
    assert a.responses.retrieve(resp.id).id == resp.id
