"""Property-based fuzzing of both generation endpoints against a real `llmserve serve`
process (a tiny random checkpoint), with request bodies generated from the JSON Schemas
the server publishes in /openapi.json.

Properties: no 5xx, no hang (every request has a timeout), every response conforms to its
published schema (JSON body, each SSE event, or the error object), and the server is
healthy afterwards with no engine step having failed. The example counts are fixed and
the search is derandomized, so the suite is reproducible and runs in well under two
minutes on two cores.
"""
from __future__ import annotations

import copy
import json
import os
import threading
import time
from typing import Any

import httpx
import pytest

hypothesis = pytest.importorskip("hypothesis")
hypothesis_jsonschema = pytest.importorskip("hypothesis_jsonschema")
jsonschema = pytest.importorskip("jsonschema")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests.gateway.gateway_server_helpers import tiny_model_server  # noqa: E402
from tests.server.server_helpers import metric_value, parse_sse  # noqa: E402

ENDPOINTS = {"/v1/chat/completions": ("ChatCompletionRequest", "ChatCompletion",
                                      "ChatCompletionChunk"),
             "/v1/completions": ("CompletionRequest", "Completion", "CompletionChunk")}
EXAMPLES = int(os.environ.get("LLMSERVE_FUZZ_EXAMPLES", "100"))   # per test
TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(base url, served model name) of a real server process on a tiny random model."""
    server = tiny_model_server(tmp_path_factory.mktemp("fuzz"), max_model_len=512)
    yield server.base_url, "tiny", server.proc, server.log_path
    server.stop()


@pytest.fixture(scope="module")
def components(served):
    spec = httpx.get(served[0] + "/openapi.json", timeout=10).json()
    for path, (req, resp, chunk) in ENDPOINTS.items():
        op = spec["paths"][path]["post"]
        assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(req)
        ok = op["responses"]["200"]["content"]
        assert ok["application/json"]["schema"]["$ref"].endswith(resp)
        data = ok["text/event-stream"]["schema"]["properties"]["data"]["anyOf"]
        assert data[0] == {"const": "[DONE]"} and chunk in json.dumps(data[1]["contentSchema"])
        assert op["responses"]["4XX"]["content"]["application/json"]["schema"]["$ref"].endswith(
            "ErrorResponse")
    return spec["components"]["schemas"]


def _narrow(components: dict[str, Any], model: str) -> dict[str, Any]:
    """The published request schemas, narrowed so that each example stays cheap: few and
    short inputs, at most 6 tokens per choice. Everything generated is still valid under
    the published schema."""
    c = copy.deepcopy(components)

    def tighten(schema: dict[str, Any], **kw: Any) -> None:
        for b in schema.get("anyOf", [schema]):
            if b.get("type") != "null":
                b.update(kw)

    for name in ("ChatCompletionRequest", "CompletionRequest"):
        props = c[name]["properties"]
        props["model"] = {"enum": [model, None]}
        props["max_tokens"] = {"type": "integer", "minimum": 1, "maximum": 6}
        c[name]["required"] = sorted(set(c[name]["required"]) | {"max_tokens"})
        tighten(props["n"], maximum=3)
        tighten(props["min_tokens"], maximum=6)
        tighten(props["stop_token_ids"], maxItems=4)
        tighten(props["stop"], maxItems=3, maxLength=12)
        props["stop"]["anyOf"][1]["items"]["maxLength"] = 12
        tighten(props["user"], maxLength=20)
        # constraints are exercised by tests/server/test_structured_outputs.py; random
        # grammars and biases would only be slow here
        props["structured_outputs"] = {"type": "null"}
        props["logit_bias"] = {"type": "null"}
    chat = c["ChatCompletionRequest"]["properties"]
    chat["max_completion_tokens"] = {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 6},
                                               {"type": "null"}]}
    chat["messages"]["maxItems"] = 3
    for name in ("tools", "tool_choice", "response_format"):
        chat[name] = {"type": "null"}
    content = c["ChatMessage"]["properties"]["content"]["anyOf"]
    content[0]["maxLength"] = 80
    content[1]["maxItems"] = 3
    c["ContentPart"]["properties"]["text"]["maxLength"] = 40
    tighten(c["ChatMessage"]["properties"]["name"], maxLength=20)
    comp = c["CompletionRequest"]["properties"]
    tighten(comp["best_of"], maximum=3)
    prompt = comp["prompt"]["anyOf"]
    prompt[0]["maxLength"] = 80
    prompt[1].update(maxItems=3)
    prompt[1]["items"]["maxLength"] = 40
    prompt[2].update(maxItems=24)
    prompt[3].update(maxItems=3)
    prompt[3]["items"]["maxItems"] = 24
    return c


def _validator(components: dict[str, Any], name: str) -> Any:
    return jsonschema.Draft202012Validator(
        {"$ref": f"#/components/schemas/{name}", "components": {"schemas": components}})


def _event_validator(components: dict[str, Any], chunk: str) -> Any:
    return jsonschema.Draft202012Validator(
        {"oneOf": [{"$ref": f"#/components/schemas/{chunk}"},
                   {"$ref": "#/components/schemas/ErrorResponse"}],
         "components": {"schemas": components}})


class Checker:
    """Posts a body and checks the properties; thread-safe counters for the report."""

    def __init__(self, url: str, components: dict[str, Any]) -> None:
        self.url = url
        self.client = httpx.Client(timeout=TIMEOUT_S)
        self.error = _validator(components, "ErrorResponse")
        self.body = {p: _validator(components, r) for p, (_, r, _) in ENDPOINTS.items()}
        self.event = {p: _event_validator(components, c) for p, (_, _, c) in ENDPOINTS.items()}
        self.statuses: dict[int, int] = {}
        self.lock = threading.Lock()

    def post(self, path: str, body: Any) -> None:
        raw = json.dumps(body).encode()   # ASCII escapes: lone surrogates travel as \udXXX
        r = self.client.post(self.url + path, content=raw,
                             headers={"content-type": "application/json"})
        with self.lock:
            self.statuses[r.status_code] = self.statuses.get(r.status_code, 0) + 1
        assert r.status_code < 500, (r.status_code, r.text[:500], raw[:500])
        if r.status_code != 200:
            self.error.validate(r.json())
            return
        if r.headers["content-type"].startswith("text/event-stream"):
            events = parse_sse(r.text)
            assert events and events[-1] == "[DONE]", r.text[-300:]
            for event in events[:-1]:
                self.event[path].validate(event)
                assert "error" not in event, event   # an error mid-stream: a server failure
        else:
            self.body[path].validate(r.json())


def _run(strategy: Any, check: Any, examples: int) -> None:
    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck), print_blob=True)
    @given(strategy)
    def prop(body: Any) -> None:
        check(body)

    prop()


@pytest.mark.parametrize("path", list(ENDPOINTS))
def test_fuzz_endpoint_from_published_schema(served, components, path):
    url, model, *_ = served
    narrowed = _narrow(components, model)
    request = ENDPOINTS[path][0]
    strategy = hypothesis_jsonschema.from_schema(
        {"$ref": f"#/components/schemas/{request}", "components": {"schemas": narrowed}})
    checker = Checker(url, components)
    _run(strategy, lambda body: checker.post(path, body), EXAMPLES)
    assert checker.statuses.get(200, 0) > 0, checker.statuses   # the fuzz reached the model


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
                    | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=12), inner, max_size=4), max_leaves=12)
FIELDS = ["model", "prompt", "messages", "max_tokens", "temperature", "top_p", "n", "stop",
          "seed", "stream", "stream_options", "logprobs", "top_logprobs", "min_tokens",
          "stop_token_ids", "priority", "repetition_penalty", "logit_bias", "response_format",
          "tools", "tool_choice", "best_of", "echo", "suffix", "user", "top_k", "min_p"]


def test_fuzz_malformed_bodies_are_4xx(served, components):
    """Valid bodies with one field replaced by arbitrary JSON, and arbitrary JSON bodies."""
    url, model, *_ = served
    checker = Checker(url, components)
    base = {"/v1/chat/completions": {"model": model, "max_tokens": 3,
                                     "messages": [{"role": "user", "content": "hi"}]},
            "/v1/completions": {"model": model, "max_tokens": 3, "prompt": "hi"}}
    mutated = st.tuples(st.sampled_from(list(ENDPOINTS)), st.sampled_from(FIELDS), JSON).map(
        lambda t: (t[0], {**base[t[0]], t[1]: t[2]}))
    anything = st.tuples(st.sampled_from(list(ENDPOINTS)), JSON)
    _run(mutated | anything, lambda pb: checker.post(*pb), EXAMPLES)


def test_issue_repro_bad_request_does_not_fail_the_batch(served):
    """The issue's reproduction: an innocent request in flight, then one with a
    repetition_penalty that used to fail the whole engine step."""
    url, model, *_ = served
    results: dict[str, httpx.Response] = {}

    def innocent() -> None:
        results["innocent"] = httpx.post(url + "/v1/completions", timeout=TIMEOUT_S, json={
            "model": model, "prompt": "x", "max_tokens": 48, "ignore_eos": True})

    t = threading.Thread(target=innocent)
    t.start()
    time.sleep(0.05)
    for bad in ({"repetition_penalty": 1e-300}, {"seed": 2**64, "temperature": 1.0},
                {"seed": -(2**63) - 1, "temperature": 1.0},
                {"min_tokens": 2, "stop_token_ids": list(range(256))}):
        r = httpx.post(url + "/v1/completions", timeout=TIMEOUT_S,
                       json={"model": model, "prompt": "Hi", "max_tokens": 4, **bad})
        assert r.status_code == 400 or (r.status_code == 200 and "stop_token_ids" in bad), r.text
    t.join(TIMEOUT_S)
    assert results["innocent"].status_code == 200
    assert results["innocent"].json()["usage"]["completion_tokens"] == 48


def test_server_healthy_after_fuzzing(served):
    url, _, proc, log = served
    assert proc.poll() is None
    assert "Traceback" not in log.read_text(), log.read_text()[-4000:]
    assert httpx.get(url + "/health", timeout=5).json() == {"status": "ok"}
    assert httpx.get(url + "/ready", timeout=5).status_code == 200
    text = httpx.get(url + "/metrics", timeout=10).text
    assert metric_value(text, "llmserve_step_errors_total") == 0   # validation caught it all
    assert metric_value(text, "llmserve_kv_cache_blocks_used") == 0
