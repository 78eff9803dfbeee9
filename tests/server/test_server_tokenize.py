"""POST /tokenize and /detokenize over a real HTTP server: counts equal what a completion
request bills as prompt_tokens, round trips, OpenAI-style errors, the gateway's auth."""
from __future__ import annotations

from typing import Callable

import httpx
import openai
import pytest

from llmserve.contract.errors import OpenAIError
from llmserve.contract.gateway_hook import Gateway, RequestContext
from tests.server.conftest import LiveServer
from tests.server.server_fakes import FakeEngine
from tests.server.server_helpers import assert_openai_error

MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "What is 2 + 2?"}]}]
TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                    "b": {"type": "integer"}}}}}]


def _client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url("/v1"), api_key="x", max_retries=0)


def test_chat_count_is_the_prompt_tokens_a_chat_completion_bills(server):
    client = _client(server)
    model = client.models.list().data[0].id
    for tools in (None, TOOLS):
        body = {"model": model, "messages": MESSAGES, **({"tools": tools} if tools else {})}
        tok = httpx.post(server.url("/tokenize"), json=body, timeout=30)
        assert tok.status_code == 200, tok.text
        out = tok.json()
        assert out["count"] == len(out["tokens"]) > 0 and out["token_strs"] is None
        assert out["max_model_len"] == client.models.list().data[0].model_extra["max_model_len"]
        done = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=1,
                                              temperature=0, **({"tools": tools} if tools else {}))
        assert done.usage.prompt_tokens == out["count"]
    plain = httpx.post(server.url("/tokenize"), json={"messages": MESSAGES}, timeout=30).json()
    no_gen = httpx.post(server.url("/tokenize"), json={
        "messages": MESSAGES, "add_generation_prompt": False}, timeout=30).json()
    assert no_gen["count"] < plain["count"]       # the assistant header is left out
    assert plain["tokens"][:no_gen["count"]] == no_gen["tokens"]


def test_text_count_round_trip_and_pieces(server):
    client = _client(server)
    model = client.models.list().data[0].id
    text = "The capital of France is Paris. Ünïcode ✓"
    out = httpx.post(server.url("/tokenize"), json={"prompt": text, "return_token_strs": True},
                     timeout=30).json()
    done = client.completions.create(model=model, prompt=text, max_tokens=1, temperature=0)
    assert done.usage.prompt_tokens == out["count"]
    assert len(out["token_strs"]) == out["count"]
    back = httpx.post(server.url("/detokenize"), json={"model": model, "tokens": out["tokens"]},
                      timeout=30)
    assert back.status_code == 200 and back.json()["prompt"].endswith(text)


def test_bad_bodies_get_openai_errors(server):
    post = lambda path, **kw: httpx.post(server.url(path), timeout=30, **kw)  # noqa: E731
    assert_openai_error(post("/tokenize", json={"prompt": "x", "model": "nope"}), 404,
                        code="model_not_found")
    assert_openai_error(post("/tokenize", content=b"{not json"), 400)
    assert_openai_error(post("/tokenize", json=["x"]), 400)
    assert_openai_error(post("/tokenize", json={"prompt": 3}), 400)
    assert_openai_error(post("/tokenize", json={"prompt": "x", "surprise": 1}), 400)
    assert_openai_error(post("/tokenize", json={"messages": []}), 400)
    assert_openai_error(post("/tokenize", json={"messages": [{"role": "wizard",
                                                              "content": "x"}]}), 400)
    assert_openai_error(post("/tokenize", json={"messages": MESSAGES, "tools": [{"x": 1}]}), 400)
    assert_openai_error(post("/detokenize", json={"tokens": [1, -1]}), 400, param="tokens")
    assert_openai_error(post("/detokenize", json={"tokens": [10 ** 9]}), 400, param="tokens")
    assert_openai_error(post("/detokenize", json={"tokens": "12"}), 400)
    # the server still answers
    assert post("/tokenize", json={"prompt": "ok"}).status_code == 200


class KeyGateway(Gateway):
    async def authenticate(self, ctx: RequestContext) -> None:
        if ctx.headers.get("authorization") != "Bearer good":
            raise OpenAIError(401, "Missing or invalid API key", code="invalid_api_key")
        ctx.tenant = "t"


def test_the_gateway_authenticates_tokenize_and_detokenize(
        start_server: Callable[..., LiveServer]):
    live = start_server(FakeEngine(), gateway=KeyGateway())
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [104]})):
        assert_openai_error(httpx.post(live.url(path), json=body, timeout=10), 401,
                            code="invalid_api_key")
        ok = httpx.post(live.url(path), json=body, headers={"Authorization": "Bearer good"},
                        timeout=10)
        assert ok.status_code == 200, ok.text


def test_a_body_over_the_cap_is_413(fake_server):
    huge = {"prompt": "a" * (300 * 1024)}
    assert_openai_error(httpx.post(fake_server.url("/tokenize"), json=huge, timeout=10), 413)


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
def test_get_is_405(fake_server, path):
    assert httpx.get(fake_server.url(path), timeout=10).status_code == 405
