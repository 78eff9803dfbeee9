"""The official openai client (sync, async, streaming) against a live server (any engine)."""
from __future__ import annotations

import asyncio

import openai
import pytest

from tests.server.conftest import LiveServer

MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name three colours."}]


def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0, timeout=60)


def expected_chat_prompt_tokens(server: LiveServer, messages: list[dict]) -> int:
    tok = server.engine.tokenizer
    return len(tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True),
                          add_special_tokens=False))


def test_chat_completion_fields_and_usage(server: LiveServer) -> None:
    raw = client(server).chat.completions.with_raw_response.create(
        model=server.engine.model_name, messages=MESSAGES, max_tokens=12, temperature=0,
        extra_headers={"X-Request-Id": "client-chosen-id.1"})
    assert raw.headers["x-request-id"] == "client-chosen-id.1"
    resp = raw.parse()
    assert resp.id == "chatcmpl-client-chosen-id.1"
    assert resp.object == "chat.completion"
    assert resp.model == server.engine.model_name
    assert resp.system_fingerprint == server.engine.fingerprint
    assert len(resp.choices) == 1
    choice = resp.choices[0]
    assert choice.index == 0 and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    usage = resp.usage
    assert usage.prompt_tokens == expected_chat_prompt_tokens(server, MESSAGES)
    assert 1 <= usage.completion_tokens <= 12
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens >= 0
    if choice.finish_reason == "length":
        assert usage.completion_tokens == 12


def test_max_tokens_with_ignore_eos_gives_exact_length(server: LiveServer) -> None:
    resp = client(server).chat.completions.create(
        messages=MESSAGES, max_completion_tokens=7, temperature=0,
        extra_body={"ignore_eos": True}, model=server.engine.model_name)
    assert resp.usage.completion_tokens == 7
    assert resp.choices[0].finish_reason == "length"


def test_missing_model_uses_default(server: LiveServer) -> None:
    resp = client(server).completions.create(model="", prompt="Once upon a time", max_tokens=3,
                                             temperature=0)
    assert resp.model == server.engine.model_name


def test_streaming_chat_matches_non_streaming(server: LiveServer) -> None:
    c = client(server)
    kwargs = dict(model=server.engine.model_name, messages=MESSAGES, max_tokens=16, temperature=0)
    full = c.chat.completions.create(**kwargs)
    chunks = list(c.chat.completions.create(stream=True, stream_options={"include_usage": True},
                                            **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(ch.id == chunks[0].id and ch.object == "chat.completion.chunk" for ch in chunks)
    assert all(ch.system_fingerprint == server.engine.fingerprint for ch in chunks)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == full.choices[0].message.content
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finals == [full.choices[0].finish_reason]
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == full.usage.completion_tokens
    assert last.usage.prompt_tokens == full.usage.prompt_tokens
    assert all(ch.usage is None for ch in chunks[:-1])


def test_completions_multiple_prompts_and_n(server: LiveServer) -> None:
    c = client(server)
    prompts = ["The capital of France is", "One, two, three,"]
    resp = c.completions.create(model=server.engine.model_name, prompt=prompts, n=2,
                                max_tokens=6, temperature=0)
    assert resp.object == "text_completion" and resp.id.startswith("cmpl-")
    assert sorted(ch.index for ch in resp.choices) == [0, 1, 2, 3]
    by_index = {ch.index: ch.text for ch in resp.choices}
    for p_idx, prompt in enumerate(prompts):
        single = c.completions.create(model=server.engine.model_name, prompt=prompt,
                                      max_tokens=6, temperature=0)
        assert by_index[p_idx * 2] == single.choices[0].text
        assert by_index[p_idx * 2 + 1] == single.choices[0].text  # greedy: n copies agree
    tok = server.engine.tokenizer
    assert resp.usage.prompt_tokens == sum(len(tok.encode(p)) for p in prompts)


def test_completions_token_id_prompts(server: LiveServer) -> None:
    c = client(server)
    tok = server.engine.tokenizer
    ids = tok.encode("Hello there")
    by_text = c.completions.create(model=server.engine.model_name, prompt="Hello there",
                                   max_tokens=5, temperature=0)
    by_ids = c.completions.create(model=server.engine.model_name, prompt=ids, max_tokens=5,
                                  temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)
    nested = c.completions.create(model=server.engine.model_name, prompt=[ids, ids[:2]],
                                  max_tokens=5, temperature=0)
    assert [ch.index for ch in sorted(nested.choices, key=lambda x: x.index)] == [0, 1]
    assert nested.usage.prompt_tokens == len(ids) + 2


def test_streaming_completions_multi_prompt(server: LiveServer) -> None:
    c = client(server)
    prompts = ["A B C", "x y z"]
    full = c.completions.create(model=server.engine.model_name, prompt=prompts, max_tokens=8,
                                temperature=0)
    texts: dict[int, str] = {0: "", 1: ""}
    finish: dict[int, str] = {}
    for chunk in c.completions.create(model=server.engine.model_name, prompt=prompts,
                                      max_tokens=8, temperature=0, stream=True):
        for ch in chunk.choices:
            texts[ch.index] += ch.text
            if ch.finish_reason:
                assert ch.index not in finish, "finish_reason sent twice"
                finish[ch.index] = ch.finish_reason
    assert texts == {ch.index: ch.text for ch in full.choices}
    assert finish == {ch.index: ch.finish_reason for ch in full.choices}


def test_stop_string_truncates_output(server: LiveServer) -> None:
    c = client(server)
    kwargs = dict(model=server.engine.model_name, prompt="Count: one two three four",
                  max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    text = c.completions.create(**kwargs).choices[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    if not stop.strip():
        pytest.skip("generated text has no usable stop string")
    stopped = c.completions.create(stop=[stop], **kwargs).choices[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == text[:text.index(stop)]


def test_chat_logprobs(server: LiveServer) -> None:
    resp = client(server).chat.completions.create(
        model=server.engine.model_name, messages=MESSAGES, max_tokens=5, temperature=0,
        logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens == 5
    for entry in content:
        assert entry.logprob <= 0.0
        assert entry.bytes == list(entry.token.encode("utf-8"))
        assert len(entry.top_logprobs) == 2


def test_completion_logprobs(server: LiveServer) -> None:
    resp = client(server).completions.create(
        model=server.engine.model_name, prompt="Hello", max_tokens=4, temperature=0, logprobs=1,
        extra_body={"ignore_eos": True})
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert all(len(top) <= 1 for top in lp.top_logprobs)


def test_seeded_sampling_is_reproducible(server: LiveServer) -> None:
    c = client(server)
    kwargs = dict(model=server.engine.model_name, prompt="Tell me a story", max_tokens=10,
                  temperature=0.9, top_p=0.9, seed=1234, extra_body={"top_k": 20, "min_p": 0.01})
    assert c.completions.create(**kwargs).choices[0].text == \
        c.completions.create(**kwargs).choices[0].text


def test_models_endpoint(server: LiveServer) -> None:
    models = client(server).models.list()
    assert [m.id for m in models.data] == [server.engine.model_name]
    assert client(server).models.retrieve(server.engine.model_name).id == server.engine.model_name
    with pytest.raises(openai.NotFoundError):
        client(server).models.retrieve("no-such-model")


def test_unknown_model_is_404(server: LiveServer) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client(server).chat.completions.create(model="gpt-nope", messages=MESSAGES, max_tokens=2)
    assert info.value.body["code"] == "model_not_found"
    assert info.value.body["param"] == "model"


def test_async_client_concurrent_requests(server: LiveServer) -> None:
    async def run() -> list:
        ac = openai.AsyncOpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0,
                                timeout=60)
        try:
            async def one(i: int) -> tuple[str, str]:
                stream = await ac.chat.completions.create(
                    model=server.engine.model_name, stream=True, max_tokens=6, temperature=0,
                    messages=[{"role": "user", "content": f"Request number {i}"}])
                text, rid = "", ""
                async for chunk in stream:
                    rid = chunk.id
                    if chunk.choices:
                        text += chunk.choices[0].delta.content or ""
                return rid, text
            results = await asyncio.gather(*(one(i) for i in range(4)))
            plain = await ac.chat.completions.create(
                model=server.engine.model_name, max_tokens=6, temperature=0,
                messages=[{"role": "user", "content": "Request number 2"}])
            return [results, plain]
        finally:
            await ac.close()

    results, plain = asyncio.run(run())
    assert len({rid for rid, _ in results}) == 4
    assert results[2][1] == plain.choices[0].message.content
