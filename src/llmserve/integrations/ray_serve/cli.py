"""``llmserve serve-ray``: the OpenAI server over engine replicas deployed by Ray Serve.

This module imports no Ray (the top-level parser registers the command whether Ray is
installed or not); :func:`cmd_serve_ray` checks for it and explains how to install it.
"""
from __future__ import annotations

import argparse
import logging
import signal
import threading
from typing import Any, Callable

logger = logging.getLogger(__name__)

INSTALL_HINT = "Ray Serve is not installed: pip install 'llmserve[ray]' (ray[serve]==2.60.0)"


def require_ray() -> None:
    """Raise a ValueError that says how to install Ray Serve when it is missing."""
    try:
        import ray.serve  # noqa: F401
    except ImportError as exc:
        raise ValueError(INSTALL_HINT) from exc


def add_serve_ray_args(p: argparse.ArgumentParser) -> None:
    """Every ``serve-ray`` flag: the engine flags and serving flags of ``serve``, routing,
    replicas, autoscaling and the Ray cluster."""
    from llmserve.cli import add_engine_args, add_server_limit_args
    from llmserve.router.cli import add_routing_policy_args
    from llmserve.server.reasoning.parsers import REASONING_PARSERS
    from llmserve.tool_parsers import TOOL_CALL_PARSERS

    add_engine_args(p)
    s = p.add_argument_group("serving (as `llmserve serve`)")
    s.add_argument("--host", default="127.0.0.1", help="Ray Serve's HTTP proxy address")
    s.add_argument("--port", type=int, default=8000, help="Ray Serve's HTTP proxy port")
    s.add_argument("--config", default=None,
                   help="gateway config file (tenants, quotas, billing); runs at the ingress")
    s.add_argument("--served-model-name", default=None)
    s.add_argument("--reasoning-parser", default="auto", choices=list(REASONING_PARSERS))
    s.add_argument("--tool-call-parser", default="auto", choices=list(TOOL_CALL_PARSERS))
    add_server_limit_args(p)
    r = p.add_argument_group("routing over replicas (docs/SCALING.md, `Ray Serve`)")
    add_routing_policy_args(r)
    r.add_argument("--stats-interval", type=float, default=1.0,
                   help="seconds between Ray Serve's polls of each replica's load and stats")
    d = p.add_argument_group("replicas and autoscaling")
    d.add_argument("--num-replicas", type=int, default=2,
                   help="engine replicas (the initial count when autoscaling)")
    d.add_argument("--min-replicas", type=int, default=None,
                   help="autoscale: fewest replicas (setting this or --max-replicas turns "
                        "autoscaling on)")
    d.add_argument("--max-replicas", type=int, default=None, help="autoscale: most replicas")
    d.add_argument("--target-ongoing-requests", type=float, default=8.0,
                   help="autoscale: requests per replica (queued + running) to aim at")
    d.add_argument("--upscale-delay", type=float, default=30.0,
                   help="autoscale: seconds above target before adding replicas")
    d.add_argument("--downscale-delay", type=float, default=600.0,
                   help="autoscale: seconds below target before removing replicas")
    d.add_argument("--max-ongoing-requests", type=int, default=256,
                   help="requests one replica holds at once (its engine queues what it cannot "
                        "run); above it Ray Serve routes elsewhere or waits")
    d.add_argument("--replica-cpus", type=float, default=None,
                   help="CPUs reserved per replica (per tensor-parallel rank); default 1, and "
                        "on CPU it is also --num-threads unless that is given")
    d.add_argument("--replica-gpus", type=float, default=None,
                   help="GPUs per replica (per rank); default 1 with --device cuda*, else 0")
    d.add_argument("--ingress-cpus", type=float, default=0.0,
                   help="CPUs reserved for the ingress (OpenAI app and gateway)")
    c = p.add_argument_group("Ray cluster")
    c.add_argument("--address", default=None,
                   help="Ray cluster to join (`auto`: the one this node runs, or "
                        "ray://host:10001); default: start a local one for this process")
    c.add_argument("--app-name", default="llmserve", help="Ray Serve application name")


def serve_ray_parser() -> argparse.ArgumentParser:
    """A parser of ``serve-ray``'s flags alone (``build_app`` parses ``serve run`` args)."""
    p = argparse.ArgumentParser(prog="llmserve serve-ray", add_help=False)
    add_serve_ray_args(p)
    return p


def _wait_for_signal() -> None:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(1.0):
        pass


def cmd_serve_ray(args: argparse.Namespace, wait: Callable[[], None] = _wait_for_signal) -> int:
    """Join (or start) the Ray cluster, deploy the application, serve until SIGINT/SIGTERM,
    then delete the application (and stop the local cluster this command started)."""
    require_ray()
    import ray
    from ray import serve

    from llmserve.integrations.ray_serve.app import build_application

    application = build_application(args)   # flag errors before any cluster starts
    started_here = args.address is None and not ray.is_initialized()
    if not ray.is_initialized():
        ray.init(address=args.address, log_to_driver=False)
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(application, name=args.app_name, route_prefix="/")
        logger.info("llmserve on Ray Serve: http://%s:%d (application %r)", args.host,
                    args.port, args.app_name)
        wait()
    finally:
        try:
            serve.delete(args.app_name)
        finally:
            if started_here:
                serve.shutdown()
                ray.shutdown()
    return 0


def add_serve_ray_command(sub: Any) -> None:
    """Register ``serve-ray`` on the top-level subparsers."""
    p = sub.add_parser("serve-ray", help="the OpenAI server over engine replicas on Ray Serve "
                                         "(needs llmserve[ray]; docs/SCALING.md)")
    add_serve_ray_args(p)
    p.set_defaults(func=cmd_serve_ray)
