"""The ingress deployment: the OpenAI app and the gateway, once, in front of the replicas.

:class:`OpenAIIngress` is decorated ``serve.ingress()`` by the app: the ASGI app is built on
the replica, after ``__init__``, by ``__serve_build_asgi_app__``, which asks an engine
replica for the engine's description, builds the :class:`RayEngineClient` and, with
``--config``, the gateway (authentication, rate limits, admission, idempotency, billing):
it runs here only, so every request is authenticated, limited and billed exactly once
whatever replica runs it. Responses name their replica in ``x-llmserve-replica``
(:class:`~llmserve.router.replica_header.ReplicaHeaderMiddleware`, as behind
``--data-parallel-size``).

Ray Serve's HTTP proxy terminates the connections, so the connection-level limits of
``llmserve serve`` (``--max-connections``, header and keep-alive timeouts) do not apply;
body size, body read timeout and tokenizer threads do (they are the app's).
"""
from __future__ import annotations

import logging
from typing import Any, Optional

from llmserve.integrations.ray_serve.engine_client import RayEngineClient
from llmserve.integrations.ray_serve.settings import IngressSettings

logger = logging.getLogger(__name__)


class OpenAIIngress:
    """The body of the ingress deployment (module docstring)."""

    def __init__(self, engine_handle: Any, settings: IngressSettings,
                 num_replicas: int = 1) -> None:
        self.engine_handle = engine_handle
        self.settings = settings
        self.num_replicas = num_replicas
        self.client: Optional[RayEngineClient] = None
        self.gateway: Any = None

    async def __serve_build_asgi_app__(self) -> Any:
        """Connect to the replicas and build the OpenAI app of ``llmserve serve`` over them
        (Ray Serve awaits this once, after ``__init__``)."""
        from llmserve.contract.server_limits import ServerLimits
        from llmserve.router.replica_header import ReplicaHeaderMiddleware
        from llmserve.server.app import create_app
        from llmserve.server.responses_api.store import ResponseStore

        s = self.settings
        client = self.client = await RayEngineClient.connect(
            self.engine_handle, s.routing, num_replicas=self.num_replicas,
            abort_timeout_s=s.abort_timeout_s)
        names = [s.served_model_name] if s.served_model_name else None
        if s.gateway_config:
            from llmserve.gateway.hook import build_gateway

            self.gateway = build_gateway(s.gateway_config, client, served_model_names=names)
        # as `llmserve serve`: the gateway config's `server` section, then the flags
        base = getattr(getattr(self.gateway, "config", None), "server", None) or ServerLimits()
        limits = base.replace(**s.limit_overrides)
        app = create_app(client, served_model_names=names, gateway=self.gateway, limits=limits,
                         responses_store=ResponseStore(s.responses_store, s.responses_ttl),
                         tool_call_parser=s.tool_call_parser,
                         reasoning_parser=s.reasoning_parser)
        app.add_middleware(ReplicaHeaderMiddleware)
        logger.info("llmserve ingress ready: %s over %s", client.model_name,
                    self.engine_handle.deployment_name)
        return app
