"""A reasoning model over a real server: a tiny random Llama whose chat template opens a
think block (DeepSeek-R1 style), so the reasoning parser is picked from the template; its
think block comes back apart (chat reasoning_content, Responses reasoning items, Anthropic
thinking blocks), streamed and not, and a thinking budget closes it after N tokens."""
from __future__ import annotations

import os
from typing import Any, Callable

import anthropic
import httpx
import openai
import pytest

from llmserve.async_llm import AsyncLLM
from llmserve.config import EngineConfig
from tests.model.tiny_checkpoints import make_tiny_checkpoint
from tests.server.conftest import LiveServer
from tests.server.server_fakes import FakeEngine
from tests.server.server_helpers import assert_openai_error

R1_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")
ASK = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = make_tiny_checkpoint(str(tmp_path_factory.mktemp("r1")), arch="llama", seed=5)
    with open(os.path.join(path, "chat_template.jinja"), "w", encoding="utf-8") as f:
        f.write(R1_TEMPLATE)
    engine = AsyncLLM.from_config(EngineConfig.from_kwargs(
        model=path, dtype="float32", num_kv_blocks=64, block_size=4, device="cpu",
        max_model_len=256))
    live = LiveServer(engine, served_model_names=["r1"]).start()
    yield live
    live.stop()
    engine.shutdown()


def _client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0)


def _chat(server: LiveServer, **kw: Any) -> dict[str, Any]:
    r = httpx.post(server.url("/v1/chat/completions"), timeout=60, json={
        "model": "r1", "messages": ASK, "max_tokens": 12, "temperature": 0,
        "ignore_eos": True, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def _tokens(server: LiveServer, text: str) -> int:
    r = httpx.post(server.url("/tokenize"), json={"prompt": text, "add_special_tokens": False},
                   timeout=10)
    return r.json()["count"]


def test_the_think_block_comes_apart_and_the_budget_closes_it(server):
    free = _chat(server)["choices"][0]["message"]
    assert free["reasoning_content"] and "</think>" not in free["reasoning_content"]
    assert not free["content"]      # a random model never closes its block in 12 tokens
    bounded = _chat(server, thinking_budget=3)
    message = bounded["choices"][0]["message"]
    assert message["reasoning_content"] and message["content"]
    assert "</think>" not in message["content"] + message["reasoning_content"]
    assert free["reasoning_content"].startswith(message["reasoning_content"])
    assert _tokens(server, message["reasoning_content"]) <= 4
    assert bounded["usage"]["completion_tokens"] == 12
    # the same request streamed: the same reasoning and answer, in their own deltas
    stream = _client(server).chat.completions.create(
        model="r1", messages=ASK, max_tokens=12, temperature=0, stream=True,
        extra_body={"ignore_eos": True, "thinking_budget": 3})
    reasoning, content = "", ""
    for chunk in stream:
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            content += choice.delta.content or ""
    assert (reasoning, content) == (message["reasoning_content"], message["content"])
    silent = _chat(server, thinking_budget=0)["choices"][0]["message"]
    assert silent["reasoning_content"] == "" and silent["content"]
    hidden = _chat(server, thinking_budget=3, include_reasoning=False)["choices"][0]["message"]
    assert "reasoning_content" not in hidden and hidden["content"] == message["content"]


def test_a_grammar_leaves_no_think_block_and_refuses_a_budget(server):
    fmt = {"type": "json_object"}
    message = _chat(server, response_format=fmt, ignore_eos=False)["choices"][0]["message"]
    assert "reasoning_content" not in message
    r = httpx.post(server.url("/v1/chat/completions"), timeout=30, json={
        "model": "r1", "messages": ASK, "max_tokens": 4, "thinking_budget": 2,
        "response_format": fmt})
    assert_openai_error(r, 400, param="thinking_budget")


def test_responses_and_messages_carry_the_reasoning(server):
    client = _client(server)
    resp = client.responses.create(model="r1", input="What is 2 + 2?", max_output_tokens=12,
                                   temperature=0, extra_body={})
    assert resp.output[0].type == "reasoning" and resp.output[0].content[0].text
    events = list(client.responses.create(model="r1", input="What is 2 + 2?", stream=True,
                                          max_output_tokens=12, temperature=0))
    streamed = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert streamed == resp.output[0].content[0].text
    quiet = client.responses.create(model="r1", input="What is 2 + 2?", max_output_tokens=12,
                                    temperature=0, reasoning={"effort": "none"})
    assert quiet.output[0].type == "message" or quiet.output[0].content[0].text == ""

    claude = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)
    msg = claude.messages.create(model="r1", max_tokens=12, messages=ASK,
                                 thinking={"type": "enabled", "budget_tokens": 3},
                                 extra_body={"temperature": 0})
    assert [b.type for b in msg.content][:2] == ["thinking", "text"]
    with claude.messages.stream(model="r1", max_tokens=12, messages=ASK,
                                thinking={"type": "enabled", "budget_tokens": 3},
                                extra_body={"temperature": 0}) as stream:
        final = stream.get_final_message()
    assert final.content[0].thinking == msg.content[0].thinking
    assert final.content[1].text == msg.content[1].text


def test_a_model_without_reasoning_refuses_a_budget(start_server: Callable[..., LiveServer]):
    live = start_server(FakeEngine())
    r = httpx.post(live.url("/v1/chat/completions"), timeout=10, json={
        "model": "fake-model", "messages": ASK, "max_tokens": 2, "thinking_budget": 5})
    assert_openai_error(r, 400, param="thinking_budget")
    ok = httpx.post(live.url("/v1/chat/completions"), timeout=10, json={
        "model": "fake-model", "messages": ASK, "max_tokens": 2})
    assert ok.status_code == 200 and "reasoning_content" not in ok.json()["choices"][0]["message"]
