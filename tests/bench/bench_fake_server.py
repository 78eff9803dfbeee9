"""A tiny OpenAI-compatible streaming server for the benchmark tests (real HTTP on 127.0.0.1).

Behaviour, chosen so the client's parsing is exercised:
* each SSE event is written in two pieces with a pause between them (split across reads);
* every third content event carries two tokens; ``usage`` (when enabled) reports the true total;
* the request numbers in ``fail_requests`` (1-based, in arrival order) get HTTP 503;
* a prompt containing ``BREAK`` gets a stream cut off after two tokens (no [DONE]).
Run as a script (``python bench_fake_server.py --port P``) for the compare tests.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import socket
import threading
import time

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_app(usage: bool = True, fail_requests: frozenset = frozenset(),
             token_delay_s: float = 0.002, model: str = "fake-model") -> Starlette:
    state = {"count": 0, "bodies": []}

    async def models(_: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": model, "object": "model"}]})

    async def health(_: Request) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    async def generate(request: Request) -> object:
        body = await request.json()
        state["count"] += 1
        state["bodies"].append(body)
        if state["count"] in fail_requests:
            return JSONResponse({"error": {"message": "overloaded"}}, status_code=503)
        chat = request.url.path.endswith("/chat/completions")
        prompt = (" ".join(m["content"] for m in body["messages"]) if chat else body["prompt"])
        n = int(body.get("max_tokens", 16))
        broken = "BREAK" in prompt

        def event(obj: object) -> bytes:
            return f"data: {json.dumps(obj)}\n\n".encode()

        def content(k: int, finish: object) -> dict:
            text = "tok " * k
            choice = ({"index": 0, "delta": {"content": text}, "finish_reason": finish} if chat
                      else {"index": 0, "text": text, "finish_reason": finish})
            return {"id": "x", "object": "chunk", "model": model, "choices": [choice]}

        async def stream():
            if chat:
                yield event({"id": "x", "choices": [{"index": 0, "delta": {"role": "assistant"},
                                                     "finish_reason": None}]})
            sent, i = 0, 0
            while sent < n:
                i += 1
                k = 2 if i % 3 == 0 and n - sent >= 2 else 1
                sent += k
                data = event(content(k, "length" if sent >= n else None))
                await asyncio.sleep(token_delay_s)
                yield data[: len(data) // 2]
                await asyncio.sleep(0.001)
                yield data[len(data) // 2:]
                if broken and sent >= 2:
                    raise RuntimeError("stream cut on purpose")
            if usage:
                yield event({"id": "x", "choices": [], "usage": {
                    "prompt_tokens": len(prompt.split()), "completion_tokens": sent,
                    "total_tokens": len(prompt.split()) + sent}})
            yield b"data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/v1/models", models), Route("/health", health),
                            Route("/v1/completions", generate, methods=["POST"]),
                            Route("/v1/chat/completions", generate, methods=["POST"])])
    app.state.bench = state
    return app


class ServerThread:
    """uvicorn serving ``app`` on a free 127.0.0.1 port in a daemon thread."""

    def __init__(self, app: Starlette) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error",
                                lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("fake server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--delay", type=float, default=0.002)
    parser.add_argument("--model-name", default="fake-model")
    args = parser.parse_args()
    uvicorn.run(make_app(token_delay_s=args.delay, model=args.model_name), host="127.0.0.1",
                port=args.port, log_level="error")
