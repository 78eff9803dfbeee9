"""A request the engine failed alone (RequestFailedError) gets its own 400/500 with an
error id; the inputs that used to fail a whole engine step are 400s up front."""
from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from llmserve.protocol import RequestFailedError
from tests.server.server_fakes import FakeEngine
from tests.server.server_helpers import assert_openai_error, metric_value, parse_sse

COMPLETIONS = "/v1/completions"


class IsolatingEngine(FakeEngine):
    """FakeEngine whose prompts "__input_fault__" / "__step_fault__" fail alone, as
    AsyncLLM reports a request the engine core isolated (before / after its first token)."""

    async def generate(self, prompt: Any, params: Any, request_id: str, **kw: Any):
        text = prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt)
        if "__input_fault__" in text:
            await asyncio.sleep(self.token_delay)
            raise RequestFailedError("the request could not be run with its parameters: "
                                     "overflow (error id err-input0001)",
                                     error_id="err-input0001", input_error=True)
        count = 0
        async for out in super().generate(prompt, params, request_id, **kw):
            yield out
            count += 1
            if "__step_fault__" in text and count == 2:
                raise RequestFailedError("the engine failed while running this request "
                                         "(error id err-step0002)", error_id="err-step0002")


@pytest.fixture
def server(start_server):
    return start_server(IsolatingEngine())


def post(server, body) -> httpx.Response:
    return httpx.post(server.url(COMPLETIONS), json=body, timeout=30)


def test_input_fault_is_400_with_error_id(server):
    for stream in (False, True):
        r = post(server, {"prompt": "__input_fault__", "stream": stream})
        err = assert_openai_error(r, 400, code="invalid_request_input")
        assert "err-input0001" in err["message"] and r.headers["x-error-id"] == "err-input0001"


def test_engine_fault_is_500_with_error_id_others_unharmed(server):
    r = post(server, {"prompt": "__step_fault__", "max_tokens": 50, "ignore_eos": True})
    err = assert_openai_error(r, 500, code="engine_error")
    assert err["type"] == "server_error" and "err-step0002" in err["message"]
    assert r.headers["x-error-id"] == "err-step0002"
    r = post(server, {"prompt": "__step_fault__", "max_tokens": 50, "ignore_eos": True,
                      "stream": True})
    events = parse_sse(r.text)
    assert r.status_code == 200 and events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == "engine_error"
    assert post(server, {"prompt": "fine"}).status_code == 200
    assert server.engine.get_stats().kv_blocks_used == 0


@pytest.mark.parametrize("field,value", [
    ("repetition_penalty", 1e-300), ("seed", 2**64), ("seed", -(2**63) - 1),
    ("temperature", 1e-300), ("presence_penalty", 3.0), ("priority", 2**40),
])
def test_step_breaking_values_are_400_up_front(server, field, value):
    body = {"prompt": "Hi", "max_tokens": 4, "temperature": 1.0, field: value}
    assert_openai_error(post(server, body), 400, param=field)


def test_step_errors_metric_is_exported(server):
    text = httpx.get(server.url("/metrics"), timeout=10).text
    assert metric_value(text, "llmserve_step_errors_total") == 0
