"""The OpenAI-compatible ASGI application (FastAPI).

Endpoints:
    POST /v1/chat/completions, POST /v1/completions   generation (SSE when ``stream``)
    POST /v1/embeddings                                embeddings (engines that pool)
    GET  /v1/models, GET /v1/models/{model}            served model names
    POST /v1/responses, GET/DELETE /v1/responses/{id}  OpenAI's Responses API, stored per tenant
    GET  /v1/responses/{id}/input_items                (server/responses_api/)
    POST /v1/messages, /v1/messages/count_tokens       Anthropic's Messages API (server/anthropic/)
    POST /tokenize, /detokenize                        a model's tokenizer (server/tokenize_api.py)
    GET  /health                                       the process is alive (always 200)
    GET  /ready                                        200 when ``engine.is_ready()``, else 503
    GET  /metrics                                      Prometheus text (docs/METRICS.md)
    GET  /openapi.json                                 OpenAPI, with the request and response
                                                       body schemas (server/protocol/openapi.py)
    GET  /, /dashboard, /ui/*, /v1/status              web playground, live dashboard and
                                                       their status JSON (server/ui/pages.py)

Every error body has the OpenAI shape ``{"error": {"message", "type", "param", "code"}}``.
"""
from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Mapping, Optional, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from llmserve.contract.engine_client import EngineClient
from llmserve.contract.errors import OpenAIError
from llmserve.contract.gateway_hook import ExtraRoute, Gateway, HTTPCall
from llmserve.contract.server_limits import ServerLimits
from llmserve.server.anthropic.routes import MessagesEndpoints, install_messages_routes
from llmserve.server.embeddings.serving import EmbeddingsEndpoint, install_embedding_routes
from llmserve.server.errors import install_error_handlers
from llmserve.server.limits import DEFAULT_LIMITS, RequestLimits
from llmserve.server.lora_adapters import lora_routes
from llmserve.server.metrics.prometheus import CONTENT_TYPE, ServerMetrics
from llmserve.server.metrics.status import StatusSampler
from llmserve.server.middleware import RequestContextMiddleware
from llmserve.server.protocol.openapi import install_openapi
from llmserve.server.protocol.response_shaping import has_fim_tokens
from llmserve.server.responses_api.routes import ResponsesEndpoints, install_responses_routes
from llmserve.server.responses_api.store import ResponseStore
from llmserve.server.serving import OpenAIServing
from llmserve.server.tokenize_api import TokenizerEndpoints, install_tokenizer_routes
from llmserve.server.ui.pages import install_ui_routes

logger = logging.getLogger(__name__)


def create_app(
    engine: EngineClient,
    *,
    served_model_names: Optional[Sequence[str]] = None,
    gateway: Optional[Gateway] = None,
    max_body_bytes: Optional[int] = None,
    engines: Optional[Mapping[str, EngineClient]] = None,
    limits: Optional[ServerLimits] = None,
    input_limits: Optional[RequestLimits] = None,
    responses_store: Optional[ResponseStore] = None,
    tool_call_parser: str = "auto",
    reasoning_parser: str = "auto",
) -> FastAPI:
    """Build the server for ``engine`` (an :class:`~llmserve.contract.engine_client.EngineClient`).

    Args:
        engine: the engine to serve.
        served_model_names: names clients may put in ``model``; the first is the
            default for requests without one. Defaults to ``[engine.model_name]``.
        gateway: optional tenant/auth/admission hook, see
            :mod:`llmserve.contract.gateway_hook`.
        max_body_bytes: largest request body accepted (413 above); overrides
            ``limits.max_body_bytes``.
        engines: more served models in the same process, served name -> engine (e.g.
            a fallback model the gateway routes to). ``engine`` stays the default.
        limits: body size, body read timeout and tokenizer threads
            (:class:`~llmserve.contract.server_limits.ServerLimits`; the connection-level
            limits are applied by :func:`~llmserve.server.launch.build_server`).
        input_limits: bounds on the request's inputs (stop strings, messages, prompt
            bytes ...); default ``RequestLimits()``, see docs/GATEWAY.md "Input limits".
        responses_store: where ``/v1/responses`` keeps stored responses (default: a
            :class:`~llmserve.server.responses_api.store.ResponseStore` in memory).
        tool_call_parser: the tool-call format (:mod:`llmserve.tool_parsers`); ``auto``
            picks each model's from its chat template.
        reasoning_parser: how models mark their reasoning
            (:mod:`llmserve.server.reasoning.parsers`); ``auto`` reads each chat template.

    The app's state holds ``engine``, ``engines`` (every served name -> its engine),
    ``metrics`` (:class:`ServerMetrics`, with its private ``registry``), ``serving``
    and ``gateway``. Engine gauges and counters are exported per engine (``model``
    label); the request latency histograms carry the default model's labels.
    """
    names = list(served_model_names) if served_model_names else [engine.model_name]
    # /metrics needs no key: series labelled by tenant only when the gateway opts in
    metrics = ServerMetrics(engine, names[0], engine.fingerprint,
                            per_tenant=bool(getattr(gateway, "per_tenant_metrics", False)))
    input_limits = input_limits or DEFAULT_LIMITS
    serving = OpenAIServing(engine, metrics, names, gateway, max_body_bytes, engines=engines,
                            limits=limits, input_limits=input_limits,
                            tool_call_parser=tool_call_parser,
                            reasoning_parser=reasoning_parser)
    for name, other in (engines or {}).items():
        if other is not engine:
            metrics.add_engine(other, name, other.fingerprint)
    store = responses_store if responses_store is not None else ResponseStore()
    all_engines = serving.engines
    names = serving.served_model_names
    started_at = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            serving.close()
            store.close()
            close_gateway = getattr(gateway, "close", None)
            if callable(close_gateway):
                close_gateway()

    app = FastAPI(title="llmserve", summary="OpenAI-compatible LLM server", lifespan=lifespan,
                  docs_url=None, redoc_url=None)
    app.state.engine = engine
    app.state.engines = all_engines
    app.state.metrics = metrics
    app.state.serving = serving
    app.state.gateway = gateway
    install_error_handlers(app)
    app.add_middleware(RequestContextMiddleware, metrics=metrics)

    if gateway is not None:
        install_gateway_routes(app, gateway)
    install_routes(app, lora_routes(serving, engine, names[0], gateway))
    register_metrics = getattr(gateway, "register_metrics", None)
    if callable(register_metrics):
        register_metrics(metrics.registry)
    install_ui_routes(app, StatusSampler(metrics.registry, gateway, engines=all_engines))
    public_models = getattr(gateway, "public_models", None)
    tokenizers = TokenizerEndpoints(serving, public_models if callable(public_models) else dict)
    install_tokenizer_routes(app, tokenizers)
    install_messages_routes(app, MessagesEndpoints(serving, tokenizers))
    install_responses_routes(app, ResponsesEndpoints(serving, tokenizers, store))
    install_embedding_routes(app, EmbeddingsEndpoint(serving))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await serving.handle(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await serving.handle(request, chat=False)

    def model_card(name: str) -> dict[str, Any]:
        eng = all_engines[name]
        card = {"id": name, "object": "model", "created": started_at, "owned_by": "llmserve",
                "root": eng.model_name, "max_model_len": eng.max_model_len}
        parent = getattr(eng, "lora_parent", None)
        if parent:   # a LoRA adapter (server/lora_adapters.py)
            card["parent"] = parent
        return card

    async def authenticate(request: Request) -> None:
        await tokenizers.authenticate(request, "models")

    def public_cards() -> dict[str, dict[str, Any]]:
        """The gateway's public names (releases), each shown like its current target."""
        public = getattr(gateway, "public_models", None)
        targets = public() if callable(public) else {}
        return {p: dict(model_card(t), id=p) for p, t in targets.items() if t in all_engines}

    @app.get("/v1/models")
    async def list_models(request: Request) -> Any:
        await authenticate(request)
        return {"object": "list",
                "data": [model_card(n) for n in names] + list(public_cards().values())}

    @app.get("/v1/models/{model_id:path}", responses={404: {
        "description": "No served model has this id (OpenAI error body, code model_not_found)",
        "content": {"application/json": {}}}})
    async def get_model(model_id: str, request: Request) -> Any:
        await authenticate(request)
        if model_id in public_cards():
            return public_cards()[model_id]
        if model_id not in names:
            raise OpenAIError(404, f"The model `{model_id}` does not exist", param="model",
                              code="model_not_found")
        return model_card(model_id)

    @app.get("/health")
    async def health() -> Any:
        return {"status": "ok"}

    @app.get("/ready", responses={503: {
        "description": "The engine is not ready yet (OpenAI error body, Retry-After)",
        "content": {"application/json": {}}}})
    async def ready() -> Any:
        try:
            is_ready = all(bool(e.is_ready()) for e in {id(e): e for e in all_engines.values()}.values())
        except Exception:  # noqa: BLE001 - a failing probe means not ready
            logger.exception("engine.is_ready() failed")
            is_ready = False
        if not is_ready:
            raise OpenAIError(503, "The engine is not ready", code="engine_not_ready",
                              headers={"Retry-After": "1"})
        return JSONResponse({"status": "ready", "model": names[0]})

    @app.get("/metrics", response_class=Response, responses={200: {
        "description": "Prometheus text exposition format",
        "content": {CONTENT_TYPE: {"schema": {"type": "string"}}}}})
    async def prometheus_metrics() -> Response:
        body = await asyncio.to_thread(metrics.render)
        return Response(content=body, media_type=CONTENT_TYPE)

    distinct = list({id(e): e for e in all_engines.values()}.values())
    vocab = [getattr(e.tokenizer, "vocab_size", None) for e in distinct]
    sizes = [v for v in vocab if isinstance(v, int)]
    install_openapi(app, input_limits, max(e.max_model_len for e in distinct),
                    max(sizes) if len(sizes) == len(vocab) else None,
                    prompt_bundles=gateway is not None and gateway.resolves_prompt_bundles,
                    fill_in_the_middle=all(has_fim_tokens(e.tokenizer) for e in distinct),
                    reasoning=all(serving.formats.reasoning_parser(e) is not None for e in distinct))
    return app


def install_gateway_routes(app: FastAPI, gateway: Gateway) -> None:
    """Serve the gateway's extra endpoints (``gateway.http_routes()``, e.g. prompt
    bundles and admin operations); their handlers get an :class:`HTTPCall`."""
    routes = getattr(gateway, "http_routes", None)
    if callable(routes):
        install_routes(app, routes())


def install_routes(app: FastAPI, routes: Sequence[ExtraRoute]) -> None:
    """Serve extra endpoints whose handlers take an :class:`HTTPCall`."""
    for route in routes:
        app.add_api_route(route.path, _route_endpoint(route), methods=[route.method],
                          include_in_schema=False)


def _route_endpoint(route: ExtraRoute) -> Any:
    async def endpoint(request: Request) -> Any:
        state = request.scope.get("state", {})
        call = HTTPCall(method=request.method, path=request.url.path,
                        headers={k.lower(): v for k, v in request.headers.items()},
                        path_params=dict(request.path_params), query=dict(request.query_params),
                        body=await request.body(), request_id=state.get("request_id", ""))
        status, body = await route.handler(call)
        return JSONResponse(body, status_code=status)
    return endpoint
