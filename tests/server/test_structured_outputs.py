"""Structured outputs with the official openai client against a real server (tiny model).

The model is a tiny random Llama with the default tokenizer, so its unconstrained output
is noise: every valid JSON document, regex match or choice below is the grammar's doing.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
from typing import Iterator, Optional

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from llmserve.model.executor.capture import LogitsCapture
from tests.server.conftest import LiveServer

pytest.importorskip("llguidance")


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory) -> Iterator[LiveServer]:
    from llmserve.async_llm import AsyncLLM
    from llmserve.config import EngineConfig
    from tests.model.tiny_checkpoints import make_tiny_checkpoint

    path = make_tiny_checkpoint(str(tmp_path_factory.mktemp("so") / "tiny"), arch="llama",
                                seed=3)
    engine = AsyncLLM.from_config(EngineConfig.from_kwargs(
        model=path, max_model_len=512, num_kv_blocks=2048, block_size=16, max_num_seqs=128,
        max_num_batched_tokens=4096, device="cpu", enforce_eager=True,
        num_threads=int(os.environ.get("LLMSERVE_TEST_THREADS", "2"))))
    live = LiveServer(engine).start()
    yield live
    live.stop()
    engine.shutdown()


def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url("/v1"), api_key="x", max_retries=0, timeout=120)


def aclient(server: LiveServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url("/v1"), api_key="x", max_retries=0,
                              timeout=300)


MESSAGES = [{"role": "user", "content": "Answer in JSON."}]


class Pet(BaseModel):
    kind: str = Field(pattern=r"^(cat|dog|fish)$")
    legs: int = Field(ge=0, le=8)


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=130)
    pets: list[Pet] = Field(max_length=3)
    nickname: Optional[str] = Field(default=None, max_length=8)


def test_parse_with_pydantic_model_returns_a_validated_object(tiny_server):
    completion = client(tiny_server).chat.completions.parse(
        model="", messages=MESSAGES, response_format=Person, max_tokens=300, temperature=1.0,
        seed=5)
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, Person)
    assert message.refusal is None
    Person.model_validate_json(message.content)


SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 999},
            "admin": {"type": "boolean"}}, "required": ["id", "admin"],
            "additionalProperties": False}},
        "required": ["user"], "additionalProperties": False},
    "array-enum": {"type": "object", "properties": {
        "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                   "minItems": 1, "maxItems": 4}},
        "required": ["colors"], "additionalProperties": False},
    "bounded-number": {"type": "object", "properties": {
        "score": {"type": "number", "minimum": -1.5, "maximum": 2.5},
        "count": {"type": "integer", "exclusiveMinimum": 0, "maximum": 20}},
        "required": ["score", "count"], "additionalProperties": False},
    "optional": {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 10},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
        "tag": {"type": "string", "maxLength": 5}},
        "required": ["title"], "additionalProperties": False},
    "pattern": {"type": "object", "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
        "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.(com|org)$"}},
        "required": ["code", "email"], "additionalProperties": False},
}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_outputs_validate(tiny_server, name):
    schema = SCHEMAS[name]
    resp = client(tiny_server).chat.completions.create(
        model="", messages=MESSAGES, max_tokens=200, temperature=1.0, seed=11, n=4,
        response_format={"type": "json_schema",
                         "json_schema": {"name": name, "schema": schema, "strict": True}})
    for choice in resp.choices:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_object_regex_and_choice(tiny_server):
    c = client(tiny_server)
    obj = c.chat.completions.create(model="", messages=MESSAGES, max_tokens=400, seed=2,
                                    temperature=0.7, response_format={"type": "json_object"},
                                    logit_bias={"16": 5})  # nudge '}' so it closes early
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    else:  # cut by max_tokens: still a prefix of an object
        assert obj.choices[0].message.content.startswith("{")
    regex = r"[a-z]{2,5}-\d{3}"
    resp = c.completions.create(model="", prompt="id:", max_tokens=20, temperature=1.0, seed=3,
                                n=8, extra_body={"structured_outputs": {"regex": regex}})
    for choice in resp.choices:
        assert re.fullmatch(regex, choice.text), choice.text
    options = ["alpha", "beta gamma", "δelta"]
    resp = c.chat.completions.create(model="", messages=MESSAGES, max_tokens=20, n=8, seed=4,
                                     temperature=1.0,
                                     extra_body={"structured_outputs": {"choice": options}})
    assert {ch.message.content for ch in resp.choices} <= set(options)
    grammar = 'start: "yes" | "no" ws num\nws: " "\nnum: /[0-9]{1,2}/'
    resp = c.completions.create(model="", prompt="q", max_tokens=10, n=4, seed=5,
                                temperature=1.0,
                                extra_body={"structured_outputs": {"grammar": grammar}})
    for choice in resp.choices:
        assert re.fullmatch(r"yes|no [0-9]{1,2}", choice.text), choice.text


def test_200_seeded_temperature_one_requests_are_all_valid(tiny_server):
    schema = {"type": "object", "properties": {
        "ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": -50, "maximum": 50},
        "tags": {"type": "array", "items": {"enum": ["x", "yy", "zzz"]}, "maxItems": 3},
        "note": {"type": "string", "maxLength": 6}},
        "required": ["ok", "n", "tags"], "additionalProperties": False}

    async def one(c: openai.AsyncOpenAI, i: int) -> list[str]:
        resp = await c.completions.create(
            model="", prompt=f"record {i}:", max_tokens=120, temperature=1.0, seed=1000 + i,
            n=20, extra_body={"structured_outputs": {"json": schema}})
        return [ch.text for ch in resp.choices]

    async def run() -> list[str]:
        c = aclient(tiny_server)
        outs = await asyncio.gather(*(one(c, i) for i in range(10)))
        await c.close()
        return [t for texts in outs for t in texts]

    texts = asyncio.run(run())
    assert len(texts) == 200
    for text in texts:
        jsonschema.validate(json.loads(text), schema)
    assert len(set(texts)) > 50   # temperature 1.0 really sampled


def test_logit_bias_minus_100_excludes_and_plus_100_forces(tiny_server):
    c = client(tiny_server)
    tok = tiny_server.engine.tokenizer
    a, b, d = 1234, 2345, 3456      # +15 puts ~98% of the mass on these three tokens
    names = {t: tok.decode([t]) for t in (a, b, d)}

    def sampled(bias: dict) -> list[str]:
        resp = c.completions.create(model="", prompt=[5, 6, 7], max_tokens=16, n=8, seed=9,
                                    temperature=1.0, logprobs=0, logit_bias=bias,
                                    extra_body={"ignore_eos": True})
        return [t for ch in resp.choices for t in ch.logprobs.tokens]

    boosted = sampled({str(t): 15 for t in (a, b, d)})
    assert names[a] in boosted and names[b] in boosted   # the boost works ...
    kept_out = sampled({str(a): -100, str(b): 15, str(d): 15})
    assert names[a] not in kept_out                       # ... and -100 keeps a out
    assert sum(t in (names[b], names[d]) for t in kept_out) > 0.8 * len(kept_out)
    forced = c.chat.completions.create(model="", messages=MESSAGES, max_tokens=6, seed=1,
                                       temperature=1.0, logit_bias={str(a): 100},
                                       extra_body={"ignore_eos": True})
    assert forced.choices[0].message.content == tok.decode([a] * 6)
    greedy = c.completions.create(model="", prompt=[5, 6, 7], max_tokens=4, temperature=0,
                                  logit_bias={str(d): 100})
    assert greedy.choices[0].text == tok.decode([d] * 4)   # the greedy fast path honours it


def test_echo_prompt_logprobs_equal_the_engines_own_scoring(tiny_server):
    import torch

    tok = tiny_server.engine.tokenizer
    prompt = "The quick brown fox jumps over the lazy dog, twice over."
    ids = tok.encode(prompt)
    for max_tokens in (0, 1):   # what lm-evaluation-harness sends
        resp = client(tiny_server).completions.create(
            model="", prompt=prompt, echo=True, logprobs=1, max_tokens=max_tokens,
            temperature=0)
        lp = resp.choices[0].logprobs
        assert resp.choices[0].text.startswith(prompt)
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        got = lp.token_logprobs[1:len(ids)]
        if max_tokens == 0:
            assert resp.choices[0].text == prompt and len(lp.token_logprobs) == len(ids)
            assert resp.usage.completion_tokens == 0
    # the engine's own scoring: one forward over the prompt, logits of every position
    engine = tiny_server.engine.engine
    runner = engine.runner
    logits = []
    original = runner.execute

    def capture(step):
        out = original(step)
        for rid, rows in (out.all_logits or {}).items():
            if rid.startswith("score@"):   # AsyncLLM's internal id of our request
                logits.append(rows)
        return out

    runner.capture, runner.execute = LogitsCapture.ALL, capture
    try:
        from llmserve.sampling_params import SamplingParams

        async def score() -> None:
            async for _ in tiny_server.engine.generate(ids, SamplingParams(max_tokens=1), "score",
                                                       cache_salt="scoring-test"):
                pass

        asyncio.run(score())
    finally:
        runner.capture, runner.execute = LogitsCapture.NONE, original
    full = torch.log_softmax(torch.cat(logits).float(), dim=-1)
    ref = full[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist()
    assert got == pytest.approx(ref, abs=1e-4)


def test_best_of_returns_the_n_most_likely_of_its_candidates(tiny_server):
    resp = client(tiny_server).completions.create(
        model="", prompt="Once", max_tokens=5, temperature=1.0, seed=3, n=2, best_of=6,
        logprobs=0)
    assert len(resp.choices) == 2 and [c.index for c in resp.choices] == [0, 1]
    sums = [sum(c.logprobs.token_logprobs) for c in resp.choices]
    assert sums == sorted(sums, reverse=True)
    assert resp.usage.completion_tokens >= 6 * 1


def test_accepted_and_ignored_fields(tiny_server):
    resp = client(tiny_server).chat.completions.create(
        model="", messages=MESSAGES, max_tokens=2, store=False, metadata={"k": "v"},
        service_tier="auto", modalities=["text"], user="u1")
    assert resp.choices[0].message.refusal is None


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "pattern": "^[A-Z]{3}$"}}, "required": ["zone"],
        "additionalProperties": False}}}


def test_named_tool_choice_yields_a_valid_call_and_the_stream_reassembles_it(tiny_server):
    c = client(tiny_server)
    kwargs = dict(model="", messages=[{"role": "user", "content": "Weather in Paris?"}],
                  tools=[WEATHER, TIME], max_tokens=120, temperature=1.0, seed=21,
                  parallel_tool_calls=False,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    resp = c.chat.completions.create(**kwargs)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])

    calls: dict[int, dict] = {}
    finish = None
    for chunk in c.chat.completions.create(stream=True, **kwargs):
        for ch in chunk.choices:
            for d in ch.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                entry["id"] = d.id or entry["id"]
                if d.function and d.function.name:
                    entry["name"] = d.function.name
                entry["arguments"] += (d.function.arguments or "") if d.function else ""
            finish = ch.finish_reason or finish
    assert finish == "tool_calls"
    assert list(calls) == [0] and calls[0]["name"] == "get_weather" and calls[0]["id"]
    assert json.loads(calls[0]["arguments"]) == args


def test_required_tool_choice_and_tool_results_fed_back(tiny_server):
    c = client(tiny_server)
    resp = c.chat.completions.create(
        model="", messages=[{"role": "user", "content": "What time is it in UTC?"}],
        tools=[WEATHER, TIME], tool_choice="required", max_tokens=200, temperature=1.0,
        seed=4, n=4)
    for choice in resp.choices:
        assert choice.finish_reason == "tool_calls"
        for call in choice.message.tool_calls:
            tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
            jsonschema.validate(json.loads(call.function.arguments),
                                tool["function"]["parameters"])
    call = resp.choices[0].message.tool_calls[0]
    follow = c.chat.completions.create(model="", max_tokens=4, tools=[WEATHER, TIME], messages=[
        {"role": "user", "content": "What time is it in UTC?"},
        resp.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "12:00"}])
    assert follow.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_auto_tool_choice_parses_hermes_blocks():
    from llmserve.server.protocol.tool_calls import check_tools, parse_tool_calls, tool_call_streamer

    tools = check_tools([WEATHER, TIME])
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Oslo", "unit": "celsius"}}\n</tool_call>\n<tool_call>\n'
            '[{"name": "get_time", "arguments": {"zone": "CET"}}]\n</tool_call>')
    content, calls = parse_tool_calls(text, tools)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo", "unit": "celsius"}), ("get_time", {"zone": "CET"})]
    assert parse_tool_calls("<tool_call>{\"name\": \"nope\"}</tool_call>", tools)[1] == []
    streamer, sent, deltas = tool_call_streamer(tools), [], []
    for i in range(0, len(text), 3):   # arbitrary cuts, markers split across pieces
        piece, d = streamer.feed(text[i:i + 3])
        sent.append(piece)
        deltas += d
    piece, d = streamer.feed("", final=True)
    sent.append(piece)
    deltas += d
    assert "".join(sent).strip() == "Let me check."
    assert [d["function"].get("name") for d in deltas if "id" in d] == ["get_weather", "get_time"]
    assert json.loads("".join(d["function"]["arguments"] for d in deltas if d["index"] == 0)) \
        == {"city": "Oslo", "unit": "celsius"}


def test_metrics_report_grammar_mask_time(tiny_server):
    from tests.server.server_helpers import metric_value

    client(tiny_server).completions.create(
        model="", prompt="m", max_tokens=8, extra_body={"structured_outputs": {"regex": "[ab]{4}"}})
    text = tiny_server.metrics_text()
    assert metric_value(text, "llmserve_grammar_mask_seconds_total") > 0
    assert metric_value(text, "llmserve_grammar_mask_rows_total") >= 4
    assert metric_value(text, "llmserve_grammar_cache_misses_total") >= 1


@pytest.mark.parametrize("spec,what", [({"regex": "[a&&b]"}, "regex"),
                                       ({"grammar": 'start: x\nx: x "a"'}, "grammar")])
def test_unsatisfiable_constraints_say_so(tiny_server, spec, what):
    """A regex or grammar that no string matches is a 400 that says so, not the library's
    internal word (llguidance's NoExtensionBias)."""
    with pytest.raises(openai.BadRequestError) as info:
        client(tiny_server).completions.create(model="", prompt="c", max_tokens=4,
                                               extra_body={"structured_outputs": spec})
    message = info.value.body["message"]
    assert f"no string matches this {what}" in message and "NoExtensionBias" not in message


def test_min_tokens_does_not_hold_a_finished_grammar_open(tiny_server):
    """A grammar row ends at the EOS its complete grammar forces, whatever min_tokens says,
    and bills only the tokens it emitted (issue: 'yes' plus 49 end-of-turn tokens)."""
    for endpoint in ("completions", "chat"):
        if endpoint == "chat":
            resp = client(tiny_server).chat.completions.create(
                model="", messages=[{"role": "user", "content": "yes or no?"}], max_tokens=50,
                temperature=0, extra_body={"structured_outputs": {"choice": ["yes"]},
                                           "min_tokens": 50})
            text = resp.choices[0].message.content
        else:
            resp = client(tiny_server).completions.create(
                model="", prompt="c", max_tokens=50, temperature=0,
                extra_body={"structured_outputs": {"choice": ["yes"]}, "min_tokens": 50})
            text = resp.choices[0].text
        assert text == "yes", endpoint
        assert resp.choices[0].finish_reason == "stop", endpoint
        assert resp.usage.completion_tokens < 10, (endpoint, resp.usage)


def test_min_tokens_and_ignore_eos_do_not_break_a_finished_grammar(tiny_server):
    resp = client(tiny_server).completions.create(
        model="", prompt="c", max_tokens=12, temperature=1.0, seed=1,
        extra_body={"structured_outputs": {"choice": ["ab", "cd"]}, "min_tokens": 12,
                    "ignore_eos": True})
    assert resp.choices[0].text in ("ab", "cd")
    assert resp.usage.completion_tokens == 12   # EOS after the grammar ended, as asked


def _streamed_calls(stream) -> tuple[dict[int, dict], Optional[str]]:
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for ch in chunk.choices:
            for d in ch.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"id": None, "name": None, "pieces": []})
                entry["id"] = d.id or entry["id"]
                if d.function and d.function.name:
                    entry["name"] = d.function.name
                if d.function and d.function.arguments:
                    entry["pieces"].append(d.function.arguments)
            finish = ch.finish_reason or finish
    return calls, finish


def test_forced_call_arguments_stream_in_pieces_and_match_the_answer(tiny_server):
    """The arguments of a streamed call arrive as they are generated (several deltas),
    and add up to exactly the non-streamed answer's arguments (same seed)."""
    c = client(tiny_server)
    kwargs = dict(model="", messages=[{"role": "user", "content": "Weather?"}],
                  tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False,
                  max_tokens=120, temperature=1.0, seed=5)
    (call,) = c.chat.completions.create(**kwargs).choices[0].message.tool_calls
    calls, finish = _streamed_calls(c.chat.completions.create(stream=True, **kwargs))
    assert finish == "tool_calls" and list(calls) == [0]
    assert calls[0]["name"] == call.function.name
    assert len(calls[0]["pieces"]) > 1
    assert "".join(calls[0]["pieces"]) == call.function.arguments
    json.loads(call.function.arguments)
