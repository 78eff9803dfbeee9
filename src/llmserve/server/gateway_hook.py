"""The hook through which a gateway (tenants, auth, rate limits, admission) joins the request path.

``create_app(engine, gateway=...)`` accepts any object with some or all of the
methods of :class:`Gateway`; missing methods are skipped. For each generation
request the server calls, in order:

1. ``authenticate(ctx)`` -- before the body is parsed; only ``ctx.headers``,
   ``ctx.client``, ``ctx.endpoint``, ``ctx.request_id`` and ``ctx.arrival_time`` are set.
   Raise :class:`~llmserve.server.errors.OpenAIError` (401/403) to reject. May set
   ``ctx.tenant``, ``ctx.cache_salt``, ``ctx.priority``, ``ctx.deadline``.
2. the server parses and validates the body, tokenizes the prompt(s) and checks
   the context length (4xx errors end the request here; no further hook is called).
3. ``admit(ctx)`` -- now ``model``, ``user``, ``stream``, ``prompt_tokens``,
   ``max_tokens`` and ``num_choices`` are known and ``priority`` holds the body's
   value (or what ``authenticate`` put there). Raise OpenAIError (429 with a
   ``Retry-After`` header, 503, ...) to reject; or adjust ``priority``,
   ``cache_salt``, ``deadline``, which are then passed to ``engine.generate``.
4. ``on_complete(ctx, outcome)`` -- exactly once for every request whose ``admit``
   returned, whatever happened next (finished, client went away, engine error).
   It is synchronous and runs on the event loop: keep it cheap and non-blocking.

``GET /v1/models`` calls ``authenticate`` only. ``/health``, ``/ready`` and
``/metrics`` call no hook.
"""
from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Union

logger = logging.getLogger(__name__)


@dataclass
class Usage:
    """Token accounting of one request (summed over its prompts and choices)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def to_openai(self) -> dict[str, Any]:
        """The OpenAI ``usage`` object."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.total_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


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
    prompt_tokens: int = 0               # over all prompts of the request
    max_tokens: int = 0                  # per choice, after filling the context
    num_choices: int = 0                 # prompts x n
    # Written by the gateway:
    tenant: Optional[str] = None
    priority: Union[int, str, None] = None
    cache_salt: Optional[str] = None
    deadline: Optional[float] = None     # time.time() instant; the engine stops the request then
    extra: dict[str, Any] = field(default_factory=dict)  # the gateway's own per-request state


@dataclass
class RequestOutcome:
    """How an admitted request ended, for ``Gateway.on_complete``.

    ``status`` is ``"completed"`` (the response was produced), ``"aborted"`` (the
    client went away first) or ``"error"`` (the engine or the server failed).
    ``finish_reasons`` are the engine's reasons per choice index (``None`` for a
    choice that never finished); ``usage`` counts the tokens actually generated.
    """

    status: str
    usage: Usage
    finish_reasons: list[Optional[str]] = field(default_factory=list)
    error: Optional[str] = None


class Gateway:
    """No-op base class; subclass and override what you need (see the module docstring)."""

    async def authenticate(self, ctx: RequestContext) -> None:
        """Identify the caller from ``ctx.headers``; raise OpenAIError(401) to reject."""

    async def admit(self, ctx: RequestContext) -> None:
        """Admit or reject (raise OpenAIError) a validated request; may set priority etc."""

    def on_complete(self, ctx: RequestContext, outcome: RequestOutcome) -> None:
        """Called once when an admitted request ends (release slots, bill usage)."""


async def call_hook(gateway: Any, name: str, ctx: RequestContext) -> None:
    """Await ``gateway.<name>(ctx)`` if the gateway has that method (sync or async)."""
    if gateway is None:
        return
    hook = getattr(gateway, name, None)
    if hook is None:
        return
    result = hook(ctx)
    if inspect.isawaitable(result):
        await result


def notify_complete(gateway: Any, ctx: RequestContext, outcome: RequestOutcome) -> None:
    """Call ``gateway.on_complete``; a failure there is logged, never raised."""
    if gateway is None:
        return
    hook = getattr(gateway, "on_complete", None)
    if hook is None:
        return
    try:
        hook(ctx, outcome)
    except Exception:  # noqa: BLE001 - a gateway bug must not break the response path
        logger.exception("gateway.on_complete failed for request %s", ctx.request_id)
