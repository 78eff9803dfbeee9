"""SIGTERM on a real `llmserve serve`: the in-flight stream completes, new requests are
refused, the process exits 0 within the drain timeout; past the timeout what remains is
aborted and the exit is still clean."""
from __future__ import annotations

import json
import signal
import threading
import time
from typing import Any

import httpx
import pytest

from tests.integrations.serve_process import ServeProcess
from tests.model.tiny_checkpoints import make_tiny_checkpoint


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny") / "m"), max_position_embeddings=4096)


class Stream(threading.Thread):
    """A streamed completion read to its end in a thread: events, and whether it closed cleanly."""

    def __init__(self, server: ServeProcess, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.server, self.max_tokens = server, max_tokens
        self.events: list[Any] = []
        self.first = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        body = {"prompt": [5, 6, 7], "max_tokens": self.max_tokens, "ignore_eos": True,
                "stream": True}
        try:
            with httpx.stream("POST", self.server.url("/v1/completions"), json=body,
                              timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        data = line[6:]
                        self.events.append(data if data == "[DONE]" else json.loads(data))
                        self.first.set()
        except httpx.HTTPError as exc:
            self.error = exc
        finally:
            self.first.set()


def refused(server: ServeProcess) -> bool:
    try:
        r = httpx.post(server.url("/v1/completions"), timeout=5,
                       json={"prompt": [5], "max_tokens": 1})
    except httpx.TransportError:
        return True    # the listener is closed
    return r.status_code == 503


def test_sigterm_lets_the_stream_finish_refuses_new_requests_and_exits_0(model: str) -> None:
    server = ServeProcess(model, "--drain-timeout", "60", "--max-model-len", "512",
                          "--num-kv-blocks", "64").wait_ready()
    try:
        stream = Stream(server, max_tokens=400)
        stream.start()
        assert stream.first.wait(60) and stream.events, stream.error
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        assert stream.is_alive(), "the stream ended before the drain could be observed"
        assert refused(server)
        stream.join(60)
        assert server.proc.wait(60) == 0, server.output()[-3000:]
        assert time.monotonic() - t0 < 60
        assert stream.error is None and stream.events[-1] == "[DONE]"
        tokens = [e for e in stream.events[:-1] if e["choices"]]
        assert tokens[-1]["choices"][0]["finish_reason"] == "length"
        assert "draining" in server.output()
    finally:
        server.stop()


def test_past_the_drain_timeout_the_rest_is_aborted_and_the_exit_is_clean(model: str) -> None:
    server = ServeProcess(model, "--drain-timeout", "1", "--max-model-len", "4096",
                          "--num-kv-blocks", "512").wait_ready()
    try:
        stream = Stream(server, max_tokens=4000)
        stream.start()
        assert stream.first.wait(60)
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(30) == 0, server.output()[-3000:]
        assert time.monotonic() - t0 < 15
        stream.join(10)
        assert not stream.is_alive()
        assert "[DONE]" not in stream.events   # cut short, not finished
    finally:
        server.stop()
