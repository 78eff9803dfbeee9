"""``llmserve engine``, ``llmserve router`` and ``serve --data-parallel-size N``.

* ``engine``: one engine process with the internal API of
  :mod:`llmserve.router.engine_service` (no OpenAI API, no gateway).
* ``router``: the OpenAI server + gateway in front of engines given by ``--backend URL``.
* ``serve --data-parallel-size N``: starts N local ``engine`` processes and serves the
  router in front of them; they stop with it.
"""
from __future__ import annotations

import argparse
import logging
import os
from typing import Any, Callable, Optional

from llmserve.router.policy import ROUTING_POLICIES, RoutingConfig

logger = logging.getLogger(__name__)

TOKEN_ENV = "LLMSERVE_ENGINE_TOKEN"


def add_router_args(p: argparse.ArgumentParser) -> None:
    """Routing and health flags shared by ``router`` and ``serve --data-parallel-size``."""
    g = p.add_argument_group("routing over replicas (docs/SCALING.md)")
    add_routing_policy_args(g)
    g.add_argument("--health-interval", type=float, default=1.0,
                   help="seconds between status polls of each replica")
    g.add_argument("--eject-after", type=int, default=2,
                   help="failed polls in a row that eject a replica")
    g.add_argument("--readmit-after", type=int, default=2,
                   help="good polls in a row that re-admit an ejected replica")


def add_routing_policy_args(g: Any) -> None:
    """The policy flags of :class:`RoutingConfig` (also used by ``serve-ray``)."""
    g.add_argument("--routing", default="prefix", choices=ROUTING_POLICIES,
                   help="prefix: consistent hashing of the first blocks' chained hashes per "
                        "tenant, least-loaded over a threshold; round-robin; least-loaded")
    g.add_argument("--affinity-blocks", type=int, default=4,
                   help="full KV blocks of the prompt that make its affinity key")
    g.add_argument("--balance-abs-tokens", type=int, default=4096,
                   help="fall back when the preferred replica has this many more outstanding "
                        "tokens than the least loaded ...")
    g.add_argument("--balance-rel", type=float, default=1.5,
                   help="... and this many times as many")
    g.add_argument("--max-waiting", type=int, default=16,
                   help="fall back when the preferred replica queues more requests")


def routing_from_args(args: argparse.Namespace) -> RoutingConfig:
    return RoutingConfig(policy=args.routing, affinity_blocks=args.affinity_blocks,
                         balance_abs_tokens=args.balance_abs_tokens,
                         balance_rel=args.balance_rel, max_waiting=args.max_waiting)


def _connect(urls: list[str], token: Optional[str], args: argparse.Namespace) -> Any:
    from llmserve.router.router_engine import RouterEngine

    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per status poll otherwise
    return RouterEngine.connect(urls, token=token, routing=routing_from_args(args),
                                poll_interval_s=args.health_interval,
                                eject_after=args.eject_after, readmit_after=args.readmit_after)


def _serve_front(router: Any, args: argparse.Namespace, limits_from_args: Callable) -> None:
    from llmserve.router.replica_header import ReplicaHeaderMiddleware
    from llmserve.server.launch import serve
    from llmserve.server.responses_api.store import ResponseStore

    names = [args.served_model_name] if args.served_model_name else None
    gateway = None
    if args.config:
        from llmserve.gateway.hook import build_gateway

        gateway = build_gateway(args.config, router, served_model_names=names)
    serve(router, args.host, args.port, log_level=str(args.log_level).lower(),
          served_model_names=names, gateway=gateway, limits=limits_from_args(args, gateway),
          responses_store=ResponseStore(args.responses_store, args.responses_ttl),
          timeout_graceful_shutdown=getattr(args, "drain_timeout", 5),
          middleware=[ReplicaHeaderMiddleware],
          tool_call_parser=getattr(args, "tool_call_parser", "auto"),
          reasoning_parser=getattr(args, "reasoning_parser", "auto"))


def engine_argv(args: argparse.Namespace, add_engine_args: Callable) -> list[str]:
    """The engine flags of ``args`` that differ from their defaults, as argv for a child."""
    probe = argparse.ArgumentParser(add_help=False)
    add_engine_args(probe)
    argv: list[str] = []
    for action in probe._actions:  # noqa: SLF001 - argparse has no public list of actions
        if not action.option_strings:
            continue
        value = getattr(args, action.dest, action.default)
        if value == action.default:
            continue
        flag = action.option_strings[0]
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            argv.append(flag)
        elif value is not None:
            argv += [flag, str(value)]
    return argv


def cmd_serve_replicas(args: argparse.Namespace, add_engine_args: Callable,
                       limits_from_args: Callable) -> int:
    """``serve --data-parallel-size N``: N engine processes behind one router front."""
    from llmserve.router.engine_processes import EngineProcesses

    if args.fallback_model:
        raise ValueError("--fallback-model is not supported with --data-parallel-size > 1")
    n = args.data_parallel_size
    threads = None
    if args.num_threads is None and str(args.device).startswith(("auto", "cpu")):
        threads = max(1, (os.cpu_count() or 1) // n)
    with EngineProcesses(n, engine_argv(args, add_engine_args), threads_per_engine=threads,
                         log_dir=args.replica_log_dir) as procs:
        urls = procs.start()
        router = _connect(urls, procs.token, args)
        try:
            _serve_front(router, args, limits_from_args)
        finally:
            router.shutdown()
    return 0


def cmd_router(args: argparse.Namespace, limits_from_args: Callable) -> int:
    """``llmserve router --backend URL ...``."""
    from llmserve.contract.names import check_name

    if args.served_model_name is not None:   # it reaches headers and labels
        check_name(args.served_model_name, "--served-model-name")
    router = _connect(args.backend, args.backend_token or os.environ.get(TOKEN_ENV), args)
    try:
        _serve_front(router, args, limits_from_args)
    finally:
        router.shutdown()
    return 0


def cmd_engine(args: argparse.Namespace, config_from_args: Callable) -> int:
    """``llmserve engine``: one engine behind the internal API, until SIGTERM/SIGINT."""
    import uvicorn

    from llmserve.async_llm import AsyncLLM
    from llmserve.router.engine_service import create_engine_app

    if args.tensor_parallel_size > 1 and int(os.environ.get("RANK", "0")) > 0:
        from llmserve.model.distributed.workers import run_worker_from_env

        run_worker_from_env(config_from_args(args))   # a torchrun rank > 0: no HTTP
        return 0
    token = args.engine_token or os.environ.get(TOKEN_ENV)
    if token is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning("engine API on %s without a token: anyone who reaches the port can "
                       "run requests (set %s)", args.host, TOKEN_ENV)
    engine = AsyncLLM.from_config(config_from_args(args))
    from llmserve.server.launch import freeze_long_lived_objects

    freeze_long_lived_objects()   # a replica's long-lived objects out of full collections
    try:
        uvicorn.run(create_engine_app(engine, token), host=args.host, port=args.port,
                    log_level=str(args.log_level).lower(), access_log=False,
                    timeout_graceful_shutdown=5)
    finally:
        engine.shutdown()
    return 0


def add_scale_commands(sub: Any, add_engine_args: Callable, config_from_args: Callable,
                       add_limit_args: Callable, limits_from_args: Callable) -> None:
    """Register ``engine`` and ``router`` on the top-level subparsers."""
    e = sub.add_parser("engine", help="one engine process for a router (internal API only)")
    add_engine_args(e)
    e.add_argument("--host", default="127.0.0.1")
    e.add_argument("--port", type=int, default=8100)
    e.add_argument("--engine-token", default=None,
                   help=f"bearer token the router must send (default: ${TOKEN_ENV})")
    e.set_defaults(func=lambda a: cmd_engine(a, config_from_args))

    r = sub.add_parser("router", help="OpenAI server + gateway routing over engine processes")
    r.add_argument("--backend", action="append", required=True, metavar="URL",
                   help="an `llmserve engine` URL; repeat for every replica")
    r.add_argument("--backend-token", default=None,
                   help=f"bearer token of the engines (default: ${TOKEN_ENV})")
    r.add_argument("--host", default="127.0.0.1")
    r.add_argument("--port", type=int, default=8000)
    r.add_argument("--config", default=None, help="gateway config file (tenants, quotas)")
    r.add_argument("--served-model-name", default=None)
    add_router_args(r)
    add_limit_args(r)
    r.set_defaults(func=lambda a: cmd_router(a, limits_from_args))
