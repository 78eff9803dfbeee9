"""The hook through which a gateway (tenants, auth, rate limits, admission) joins the request path.

``create_app(engine, gateway=...)`` accepts any object with some or all of the
methods of :class:`Gateway`; missing methods are skipped, and each may be a plain
function or a coroutine function. For each generation request the server calls:

1. ``authenticate(ctx)`` -- before the body is parsed; only ``ctx.headers``,
   ``ctx.client``, ``ctx.endpoint``, ``ctx.request_id`` and ``ctx.arrival_time`` are set.
   Raise :class:`~llmserve.contract.errors.OpenAIError` (401/403) to reject. May set
   ``ctx.tenant``, ``ctx.cache_salt``, ``ctx.priority``, ``ctx.deadline``.
1b. ``preadmit(ctx)`` -- admission before any work, from the raw size only:
   ``ctx.body_bytes`` is set. Called before the body is read when the client declared
   ``Content-Length``, else right after reading it (the read is capped by the
   server's ``max_body_bytes``); never after parsing. Raise OpenAIError (429 with
   ``Retry-After``, 413, ...) to reject: rate limits and size caps go here, so a tenant
   whose budget is spent costs no parsing and no tokenization.
2. the server parses and validates the body and resolves the model (4xx errors end
   the request here).
3. ``prepare(ctx)`` -- now ``model``, ``user``, ``stream`` and ``raw_body`` are set.
   Check what the request asks for (403), claim an idempotency key (409/422), or set
   ``ctx.replay`` to a :class:`CapturedResponse`: the server then sends that response
   as it is (JSON body, or the stored SSE events) and calls no further hook. A
   gateway that serves a public name (``public_models()``, e.g. a release) sets
   ``ctx.served_model`` here: the server tokenizes with that model's engine; and it may
   set ``ctx.sampling_defaults`` (temperature, top_p, max_tokens ... for the fields
   the request omits).
4. the server tokenizes the prompt(s) (on threads shared fairly by ``ctx.tenant``)
   and checks the context length; ``prompt_tokens`` and ``longest_prompt_tokens`` are
   set as soon as the prompt is tokenized, so ``on_reject`` can charge for it.
5. ``admit(ctx)`` -- now ``prompt_token_ids``, ``sampling_params``, ``prompt_tokens``, ``longest_prompt_tokens``, ``max_tokens``
   (``max_tokens_requested`` is None when the client did not set one and
   ``max_tokens`` is the rest of the context), and ``num_choices`` are known and
   ``priority`` holds the body's value (or what an earlier hook put there). Raise OpenAIError (429 with a ``Retry-After`` header,
   503, ...) to reject; or adjust ``priority``, ``cache_salt``, ``deadline``,
   ``queue_deadline``, which are then passed to ``engine.generate``, and
   ``served_model`` to serve the request with another served model (a fallback).
6. ``on_started(ctx)`` -- when the engine's first output for the request arrives
   (it has been scheduled). At most once; never for a request the engine dropped
   before scheduling it.
7. ``on_complete(ctx, outcome)`` -- exactly once for every request whose ``admit``
   returned, whatever happened next (finished, client went away, engine error).
   It is awaited before the response ends: before a JSON body is sent, and before
   a stream's ``data: [DONE]`` (for a client that went away, after it left).
   ``outcome.response`` holds the response as sent when ``ctx.capture_response``
   was set.

``on_reject(ctx, error)`` is called exactly once for every generation request whose
``authenticate`` returned but that was neither admitted nor replayed: an error in
any of steps 1b-5 (including one raised by ``preadmit``, ``prepare`` or ``admit``
themselves), so a gateway can release what it holds for the request (an idempotency
claim, a rate-limit reservation) in one place.

``GET /v1/models``, ``POST /tokenize``, ``POST /detokenize`` and ``POST
/v1/messages/count_tokens`` call ``authenticate`` only; ``POST /v1/messages`` calls it
(endpoint ``messages``) before its body is read, then runs as a chat completion. ``/health``, ``/ready`` and
``/metrics`` call no hook.

In ``prepare`` a gateway may also set ``ctx.prefix_messages`` (chat messages the
server puts before the request's own, e.g. a prompt bundle's; the server answers 400
to a ``prompt_bundle`` field that no gateway resolved) and ``ctx.response_headers``
(added to the response). Two optional methods extend the app: ``http_routes()``
returns :class:`ExtraRoute` s the app serves (e.g. admin endpoints; the handler gets
an :class:`HTTPCall` and returns ``(status, JSON body)`` or raises OpenAIError), and
``register_metrics(registry)`` adds collectors to the app's Prometheus registry.
"""
from __future__ import annotations

import enum
import inspect
import logging
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Mapping, Optional, Union

logger = logging.getLogger(__name__)


@dataclass
class Usage:
    """Token accounting of one request (summed over its prompts and choices)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    # Predicted Outputs: only for requests that brought a prediction
    accepted_prediction_tokens: Optional[int] = None
    rejected_prediction_tokens: Optional[int] = None

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def to_openai(self) -> dict[str, Any]:
        """The OpenAI ``usage`` object."""
        usage: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.total_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }
        if self.accepted_prediction_tokens is not None:
            usage["completion_tokens_details"] = {
                "accepted_prediction_tokens": self.accepted_prediction_tokens,
                "rejected_prediction_tokens": self.rejected_prediction_tokens or 0}
        return usage


@dataclass
class CapturedResponse:
    """A whole response as sent: status, the headers worth replaying, and either the
    JSON ``body`` or, for a stream, ``events``: the SSE ``data:`` payloads in order
    (JSON text exactly as sent, the last one ``"[DONE]"``)."""

    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: Any = None
    events: Optional[list[str]] = None
    request_id: Optional[str] = None     # the X-Request-Id it was sent with
    #: "idempotency" (sent with ``Idempotent-Replayed: true``) or "cache" (a response-
    #: cache hit: sent as stored, with the new request's own X-Request-Id)
    replay_kind: str = "idempotency"

    @property
    def streamed(self) -> bool:
        return self.events is not None


@dataclass
class RequestContext:
    """One request as the gateway sees it; the gateway may write the marked fields."""

    request_id: str                      # the engine request id (unique among in-flight)
    endpoint: str                        # "chat.completions" | "completions" | "models"
    headers: Mapping[str, str]           # request headers, names lower-cased
    client: Optional[str]                # peer address, when known
    arrival_time: float                  # time.time() when the server received the request
    model: Optional[str] = None          # the served model name asked for
    user: Optional[str] = None           # the body's "user" field
    stream: bool = False
    raw_body: bytes = b""                # the request body as received (valid JSON)
    body_bytes: Optional[int] = None     # declared Content-Length, else the body's length
    prompt_tokens: int = 0               # over all prompts of the request
    longest_prompt_tokens: int = 0       # the longest single prompt
    max_tokens: int = 0                  # per choice, after filling the context
    max_tokens_requested: Optional[int] = None  # what the client asked for (None: not set)
    num_choices: int = 0                 # prompts x n
    prompt_token_ids: Optional[list[list[int]]] = None  # set before admit: the prompts' tokens
    sampling_params: Any = None          # set before admit: the request's SamplingParams
    # Written by the gateway:
    tenant: Optional[str] = None
    priority: Union[int, str, None] = None
    cache_salt: Optional[str] = None
    deadline: Optional[float] = None     # time.time() instant; the engine stops the request then
    queue_deadline: Optional[float] = None  # time.time(); dropped ("queue_timeout") if not started
    served_model: Optional[str] = None   # serve with this served model instead of ``model``
    replay: Optional[CapturedResponse] = None  # set in prepare(): send this, run nothing
    capture_response: bool = False       # hand the response to on_complete (outcome.response)
    prefix_messages: Optional[list[dict[str, Any]]] = None  # set in prepare(): go before messages
    prefix_tools: Optional[list[dict[str, Any]]] = None  # set in prepare(): go before tools
    response_headers: dict[str, str] = field(default_factory=dict)  # added to the response
    sampling_defaults: Optional[dict[str, Any]] = None  # set in prepare(): for omitted fields
    release_fingerprint: Optional[str] = None  # set in prepare(): the serving release's identity
    #: the gateway's own per-request state (the server never reads it); typed by its owner
    gateway_state: object = None


class OutcomeStatus(enum.StrEnum):
    """How an admitted request ended (see :class:`RequestOutcome`)."""

    COMPLETED = "completed"   # the response was produced
    ABORTED = "aborted"       # the client went away first
    ERROR = "error"           # the engine or the server failed, and an error was sent


@dataclass
class RequestOutcome:
    """How an admitted request ended, for ``Gateway.on_complete``.

    ``status`` is ``"completed"`` (the response was produced), ``"aborted"`` (the
    client went away first) or ``"error"`` (the engine or the server failed, or every
    choice ended without a token, e.g. ``queue_timeout``, and an error was sent).
    ``finish_reasons`` are the engine's reasons per choice index (``None`` for a
    choice that never finished); ``usage`` is what the engine computed: the prompt (and
    cached) tokens of the prompts it scheduled -- 0 for a request that ended before it
    was scheduled, whatever ended it -- and the tokens generated. ``http_status`` is
    None when the client went away before any response, with or without a response
    kept for replay.
    """

    status: OutcomeStatus
    usage: Usage
    finish_reasons: list[Optional[str]] = field(default_factory=list)
    error: Optional[str] = None
    served_model: Optional[str] = None     # the served model name that ran it
    fingerprint: Optional[str] = None      # that engine's fingerprint
    started: bool = False                  # the engine had scheduled it (on_started was called)
    http_status: Optional[int] = None      # status sent; None: the client left before any response
    response: Optional[CapturedResponse] = None  # with ctx.capture_response: what was sent


@dataclass
class HTTPCall:
    """One call of an :class:`ExtraRoute`: what its handler may read."""

    method: str
    path: str
    headers: Mapping[str, str]           # names lower-cased
    path_params: dict[str, str]
    query: dict[str, str]
    body: bytes
    request_id: str = ""


@dataclass(frozen=True)
class ExtraRoute:
    """An endpoint a gateway adds to the app: ``handler(call) -> (status, JSON body)``."""

    method: str
    path: str                            # FastAPI path syntax, e.g. "/v1/prompt_bundles/{name}"
    handler: Callable[[HTTPCall], Awaitable[tuple[int, Any]]]


class Gateway:
    """No-op base class; subclass and override what you need (see the module docstring)."""

    #: whether /metrics may carry series labelled by tenant or cache namespace (/metrics
    #: needs no key, so a gateway opts in; aggregates otherwise)
    per_tenant_metrics: bool = False
    #: whether ``prepare`` resolves a chat request's ``prompt_bundle`` (into
    #: ``ctx.prefix_messages``); /openapi.json lists the field only then
    resolves_prompt_bundles: bool = False

    async def authenticate(self, ctx: RequestContext) -> None:
        """Identify the caller from ``ctx.headers``; raise OpenAIError(401) to reject."""

    async def preadmit(self, ctx: RequestContext) -> None:
        """Rate-limit / size-check a request from ``ctx.body_bytes`` before it is parsed."""

    async def prepare(self, ctx: RequestContext) -> None:
        """Check a parsed request (403), claim its idempotency key or set ``ctx.replay``."""

    async def admit(self, ctx: RequestContext) -> None:
        """Admit or reject (raise OpenAIError) a validated request; may set priority etc."""

    def on_started(self, ctx: RequestContext) -> None:
        """The engine scheduled the request (its first output arrived)."""

    async def on_complete(self, ctx: RequestContext, outcome: RequestOutcome) -> None:
        """Called once when an admitted request ends (release slots, bill usage)."""

    async def on_reject(self, ctx: RequestContext, error: BaseException) -> None:
        """Called once when an authenticated request ends before admission."""


async def call_hook(gateway: Optional[Gateway], name: str, ctx: RequestContext) -> None:
    """Await ``gateway.<name>(ctx)`` if the gateway has that method (sync or async)."""
    if gateway is None:
        return
    hook = getattr(gateway, name, None)
    if hook is None:
        return
    result = hook(ctx)
    if inspect.isawaitable(result):
        await result


async def notify(gateway: Optional[Gateway], name: str, ctx: RequestContext, *args: Any) -> None:
    """Call (and await) ``gateway.<name>(ctx, *args)``; a failure there is logged, never raised."""
    if gateway is None:
        return
    hook = getattr(gateway, name, None)
    if hook is None:
        return
    try:
        result = hook(ctx, *args)
        if inspect.isawaitable(result):
            await result
    except Exception:  # noqa: BLE001 - a gateway bug must not break the response path
        logger.exception("gateway.%s failed for request %s", name, ctx.request_id)


async def notify_complete(gateway: Optional[Gateway], ctx: RequestContext, outcome: RequestOutcome) -> None:
    """Call ``gateway.on_complete``; a failure there is logged, never raised."""
    await notify(gateway, "on_complete", ctx, outcome)


def notify_started(gateway: Optional[Gateway], ctx: RequestContext) -> None:
    """Call the synchronous ``gateway.on_started``; a failure there is logged, never raised."""
    hook = getattr(gateway, "on_started", None) if gateway is not None else None
    if hook is None:
        return
    try:
        hook(ctx)
    except Exception:  # noqa: BLE001
        logger.exception("gateway.on_started failed for request %s", ctx.request_id)
