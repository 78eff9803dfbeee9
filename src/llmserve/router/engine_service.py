"""The HTTP face of one engine process behind a router (``llmserve engine``).

It serves no OpenAI API, no gateway and no billing: the router front does all that once.
Endpoints (JSON; ``Authorization: Bearer <token>`` required when a token is set):

    GET  /health                 200 while the process runs
    GET  /ready                  200 when the engine can take requests, else 503
    GET  /internal/v1/info       model name, fingerprint, context, block size, tokenizer
    GET  /internal/v1/status     ready flag, EngineStats, requests in flight
    POST /internal/v1/generate   {request_id, prompt: [ids], params, priority, cache_salt,
                                 deadline, queue_deadline} -> NDJSON events
                                 {"output": {...}} ... or a last {"error": {...}}
    POST /internal/v1/abort      {request_id} -> {"output": final output or null}

Closing a generate stream aborts its request in the engine (the generator is closed).
No torch is imported here: the engine object arrives ready-made.
"""
from __future__ import annotations

import hmac
import logging
from typing import Any, AsyncIterator, Optional

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, StreamingResponse

from llmserve.router.wire import (
    WIRE_VERSION,
    encode_line,
    error_to_dict,
    output_to_dict,
    params_from_dict,
    stats_to_dict,
    tokenizer_to_dict,
)

logger = logging.getLogger(__name__)


def create_engine_app(engine: Any, token: Optional[str] = None) -> FastAPI:
    """A FastAPI app exposing ``engine`` (an ``EngineClient``, e.g. AsyncLLM) to a router."""
    app = FastAPI(title="llmserve engine", docs_url=None, redoc_url=None, openapi_url=None)
    in_flight: set[str] = set()
    info = {"wire_version": WIRE_VERSION, "model_name": engine.model_name,
            "fingerprint": engine.fingerprint, "max_model_len": engine.max_model_len,
            "block_size": engine.block_size, "tokenizer": tokenizer_to_dict(engine.tokenizer)}

    def check_token(request: Request) -> None:
        if token is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            raise HTTPException(401, "missing or wrong engine token")

    @app.get("/health")
    async def health() -> Any:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> Any:
        if not engine.is_ready():
            return JSONResponse({"status": "not ready"}, status_code=503)
        return {"status": "ready"}

    @app.get("/internal/v1/info")
    async def get_info(request: Request) -> Any:
        check_token(request)
        return info

    @app.get("/internal/v1/status")
    async def status(request: Request) -> Any:
        check_token(request)
        return {"ready": bool(engine.is_ready()), "stats": stats_to_dict(engine.get_stats()),
                "in_flight": len(in_flight)}

    @app.post("/internal/v1/generate")
    async def generate(request: Request) -> Any:
        check_token(request)
        body = await request.json()
        try:
            request_id = str(body["request_id"])
            prompt = [int(t) for t in body["prompt"]]
            params = params_from_dict(body["params"])
        except (KeyError, TypeError, ValueError) as exc:
            raise HTTPException(400, f"bad generate request: {exc}") from exc
        return StreamingResponse(_events(request_id, prompt, params, body),
                                 media_type="application/x-ndjson")

    async def _events(request_id: str, prompt: list[int], params: Any,
                      body: dict) -> AsyncIterator[bytes]:
        in_flight.add(request_id)
        stream = None
        try:
            extra = {"prediction": body["prediction"]} if body.get("prediction") else {}
            stream = engine.generate(prompt, params, request_id, priority=body.get("priority"),
                                     cache_salt=body.get("cache_salt"),
                                     deadline=body.get("deadline"),
                                     queue_deadline=body.get("queue_deadline"), **extra)
            async for out in stream:
                yield encode_line({"output": output_to_dict(out, with_prompt=False)})
        except Exception as exc:  # noqa: BLE001 - every failure goes to the router as an event
            if not isinstance(exc, ValueError):
                logger.warning("request %s failed in the engine: %r", request_id, exc)
            yield encode_line({"error": error_to_dict(exc)})
        finally:
            in_flight.discard(request_id)
            if stream is not None:
                await stream.aclose()

    @app.post("/internal/v1/abort")
    async def abort(request: Request) -> Any:
        check_token(request)
        body = await request.json()
        final = await engine.abort(str(body.get("request_id", "")))
        return {"output": output_to_dict(final) if final is not None else None}

    return app
