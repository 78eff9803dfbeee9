"""Small helpers shared by the server tests (SSE parsing, error shape, metrics lookup)."""
from __future__ import annotations

import json
import time
from typing import Any, Callable, Optional

import httpx
from prometheus_client.parser import text_string_to_metric_families


def parse_sse(raw: str) -> list[Any]:
    """Split an SSE body into events; JSON payloads are decoded, ``[DONE]`` stays a string.

    Fails if the framing is not exactly ``data: <payload>\\n\\n`` repeated.
    """
    assert raw.endswith("\n\n"), f"stream does not end with a blank line: {raw[-40:]!r}"
    events = []
    for block in raw[:-2].split("\n\n"):
        assert block.startswith("data: "), f"bad SSE event {block[:60]!r}"
        assert "\n" not in block, f"multi-line SSE event {block[:60]!r}"
        payload = block[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def assert_openai_error(resp: httpx.Response, status: int, *, param: Optional[str] = None,
                        code: Optional[str] = None) -> dict[str, Any]:
    """Assert an OpenAI-shaped error with this status (and param / code when given)."""
    assert resp.status_code == status, (resp.status_code, resp.text)
    assert resp.headers["content-type"].startswith("application/json")
    assert resp.headers.get("x-request-id"), "errors must carry X-Request-Id"
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def metric_samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """All samples of a Prometheus exposition: (name, sorted labels) -> value."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def metric_value(text: str, name: str, **labels: str) -> float:
    """Sum of the samples named ``name`` whose labels include ``labels`` (0 if none)."""
    total = 0.0
    for (sample, lbls), value in metric_samples(text).items():
        if sample == name and all(dict(lbls).get(k) == v for k, v in labels.items()):
            total += value
    return total


def wait_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.01) -> bool:
    """Poll ``predicate`` until true or ``timeout`` seconds pass; returns its last value."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)


def wait_idle(engine: Any, timeout: float = 10.0) -> None:
    """Wait until the engine runs and queues nothing (earlier tests' aborts have landed)."""
    def idle() -> bool:
        s = engine.get_stats()
        return s.num_running == 0 and s.num_waiting == 0
    assert wait_until(idle, timeout), f"engine not idle: {engine.get_stats()}"


def chat_body(content: str = "Say something.", **kw: Any) -> dict[str, Any]:
    """A minimal valid chat request body."""
    body: dict[str, Any] = {"messages": [{"role": "user", "content": content}]}
    body.update(kw)
    return body
