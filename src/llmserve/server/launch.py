"""Run the server in-process with uvicorn (one worker: the engine lives in this process)."""
from __future__ import annotations

import gc
import logging
from typing import Any, Callable, Optional, Sequence

import uvicorn

from llmserve.contract.engine_client import EngineClient
from llmserve.contract.server_limits import ServerLimits
from llmserve.server.app import create_app
from llmserve.server.drain import DrainGate, DrainingServer, DrainState

logger = logging.getLogger(__name__)


def build_server(
    engine: EngineClient,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
    *,
    access_log: bool = True,
    timeout_graceful_shutdown: Optional[int] = 5,
    limits: Optional[ServerLimits] = None,
    middleware: Sequence[Callable[[Any], Any]] = (),
    **app_kwargs: Any,
) -> uvicorn.Server:
    """A configured (not yet running) uvicorn Server for ``engine``.

    ``middleware``: extra pure-ASGI classes wrapped around the app (outermost last),
    e.g. a router's replica header. ``limits`` (default :class:`~llmserve.contract.server_limits.ServerLimits`) sets the
    connection cap, keep-alive and header timeouts, the largest request head, and goes
    to the app for the body limits. ``app_kwargs`` go to
    :func:`~llmserve.server.app.create_app` (``served_model_names``, ``gateway``,
    ``max_body_bytes``).

    Call ``server.run()`` to serve in the calling thread, or run it in a background
    thread and set ``server.should_exit = True`` to stop it (signal handlers are
    installed only on the main thread). On SIGTERM it drains: new requests get 503,
    in-flight ones have ``timeout_graceful_shutdown`` seconds to finish
    (:mod:`llmserve.server.drain`).
    """
    limits = limits or ServerLimits()
    app = create_app(engine, limits=limits, **app_kwargs)
    for layer in middleware:
        app.add_middleware(layer)   # a pure-ASGI class
    drain = DrainState()
    app.add_middleware(DrainGate, state=drain)
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, workers=1, access_log=access_log,
        lifespan="on", timeout_graceful_shutdown=timeout_graceful_shutdown,
        **limits.uvicorn_kwargs())
    return DrainingServer(config, drain)


def serve(engine: EngineClient, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
          **kwargs: Any) -> None:
    """Serve ``engine`` over HTTP until interrupted (SIGINT/SIGTERM). Blocks.

    Extra keyword arguments (``served_model_names``, ``gateway``, ...) go to
    :func:`build_server`.
    """
    server = build_server(engine, host, port, log_level, **kwargs)
    logger.info("serving %s on http://%s:%d", getattr(engine, "model_name", "?"), host, port)
    freeze_long_lived_objects()
    server.run()


def freeze_long_lived_objects() -> None:
    """Move what the process holds at start (the engine and its model, the imported
    libraries: ~430k objects on the default model) out of the garbage collector's reach.
    A full collection scans every tracked object while the engine thread waits for the
    GIL: 270-300 ms in a suffix-decoding server, a stalled step for every stream, whenever
    enough new objects (the trees' nodes) have built up; frozen, it scans only what came
    after (docs/BENCHMARKS.md, "Garbage-collector stalls"). Garbage made before is
    collected first, so nothing unreachable at start is kept."""
    gc.collect()
    gc.freeze()
    logger.debug("garbage collector: %d objects frozen", gc.get_freeze_count())
