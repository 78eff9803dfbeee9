"""The Ray Serve application: engine replicas behind the OpenAI ingress.

:func:`build_application` turns ``serve-ray``'s flags into a bound application::

    LlmserveIngress (OpenAI app, gateway; one replica)
        └── handle ──> LlmserveEngine x N (AsyncLLM each; llmserve's request router)

``build_app`` (the package's entry point) does the same from a ``serve run`` config's
``args`` or keyword arguments.
"""
from __future__ import annotations

import argparse
from typing import Any, Mapping, Optional

from ray import serve

from llmserve.integrations.ray_serve.engine_replica import EngineReplica
from llmserve.integrations.ray_serve.ingress import OpenAIIngress
from llmserve.integrations.ray_serve.request_router import LlmserveRequestRouter
from llmserve.integrations.ray_serve.settings import (
    INGRESS_DEPLOYMENT,
    engine_deployment_options,
    ingress_settings,
    namespace_from_mapping,
    replica_resources,
)


def build_application(args: argparse.Namespace) -> Any:
    """The bound application for parsed ``serve-ray`` flags (flag errors: ValueError)."""
    from llmserve.cli import engine_config_from_args

    if args.served_model_name is not None:
        from llmserve.contract.names import check_name

        check_name(args.served_model_name, "--served-model-name")
    cpus, _ = replica_resources(args)
    if args.num_threads is None and str(args.device).startswith(("auto", "cpu")):
        args.num_threads = max(1, int(cpus))   # torch would otherwise take every core
    engine_config = engine_config_from_args(args)
    options = engine_deployment_options(args, LlmserveRequestRouter, args.stats_interval)
    deployment: Any = serve.deployment   # (its overloads confuse mypy)
    engine = deployment(EngineReplica).options(**options)
    ingress = deployment(serve.ingress()(OpenAIIngress)).options(
        name=INGRESS_DEPLOYMENT, num_replicas=1,
        max_ongoing_requests=args.max_connections or 1024,
        ray_actor_options={"num_cpus": args.ingress_cpus})
    return ingress.bind(engine.bind(engine_config), ingress_settings(args), args.num_replicas)


def build_app(args: Optional[Mapping[str, Any]] = None, **kwargs: Any) -> Any:
    """The application for ``serve-ray`` options given as a mapping (a ``serve run``
    config's ``args``: ``{"model": "/m", "num_replicas": 2, "routing": "prefix"}``) and/or
    keyword arguments; see :func:`~.settings.namespace_from_mapping`."""
    from llmserve.integrations.ray_serve.cli import serve_ray_parser

    values = {**dict(args or {}), **kwargs}
    return build_application(namespace_from_mapping(values, serve_ray_parser))
