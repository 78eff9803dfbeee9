"""``--tool-call-parser`` end to end: a server told to use the Mistral format forces,
reads and streams calls in it (tiny random model, official openai client)."""
from __future__ import annotations

import json
import os
from typing import Iterator

import httpx
import jsonschema
import openai
import pytest

from tests.server.conftest import LiveServer
from tests.server.test_structured_outputs import TIME, WEATHER, _streamed_calls

pytest.importorskip("llguidance")


@pytest.fixture(scope="module")
def mistral_server(tmp_path_factory) -> Iterator[LiveServer]:
    from llmserve.async_llm import AsyncLLM
    from llmserve.config import EngineConfig
    from tests.model.tiny_checkpoints import make_tiny_checkpoint

    path = make_tiny_checkpoint(str(tmp_path_factory.mktemp("tp") / "tiny"), arch="llama",
                                seed=3)
    engine = AsyncLLM.from_config(EngineConfig.from_kwargs(
        model=path, max_model_len=512, num_kv_blocks=512, block_size=16, max_num_seqs=8,
        device="cpu", enforce_eager=True,
        num_threads=int(os.environ.get("LLMSERVE_TEST_THREADS", "2"))))
    live = LiveServer(engine, tool_call_parser="mistral").start()
    yield live
    live.stop()
    engine.shutdown()


def test_a_forced_call_is_written_and_read_in_the_mistral_format(mistral_server):
    c = openai.OpenAI(base_url=mistral_server.url("/v1"), api_key="x", max_retries=0,
                      timeout=120)
    kwargs = dict(model="", messages=[{"role": "user", "content": "Weather?"}],
                  tools=[WEATHER, TIME], tool_choice="required", max_tokens=160,
                  temperature=1.0, seed=8)
    resp = c.chat.completions.create(**kwargs)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    for call in choice.message.tool_calls:
        tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    calls, finish = _streamed_calls(c.chat.completions.create(stream=True, **kwargs))
    assert finish == "tool_calls"
    assert [(calls[i]["name"], "".join(calls[i]["pieces"])) for i in sorted(calls)] == [
        (call.function.name, call.function.arguments) for call in choice.message.tool_calls]
    assert any(len(entry["pieces"]) > 1 for entry in calls.values())
    # the prompt describes the same format (the template has no tool support)
    tokens = httpx.post(mistral_server.url("/tokenize"), json={
        "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER],
        "return_token_strs": True}, timeout=30).json()
    assert "[TOOL_CALLS]" in "".join(tokens["token_strs"])
