"""What a ``serve-ray`` deployment is made of, decided from the flags (no Ray, no torch).

Everything here is plain data so it can be built and checked without a cluster:

* :class:`IngressSettings` travels to the ingress replica (served names, gateway config,
  HTTP limits, Responses store, parsers, routing knobs);
* :func:`engine_deployment_options` is the ``serve.deployment`` options of the engine
  replicas: replica count or autoscaling, concurrency cap, CPUs / GPUs per replica, a
  placement group when a replica spans tensor-parallel ranks, and the request router;
* :func:`namespace_from_mapping` turns a ``serve run`` config's ``args`` (or Python
  keyword arguments) into the same ``argparse.Namespace`` the CLI parses, so both entry
  points share one path.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

from llmserve.router.policy import RoutingConfig

#: Names of the two deployments of the application.
ENGINE_DEPLOYMENT = "LlmserveEngine"
INGRESS_DEPLOYMENT = "LlmserveIngress"

#: The HTTP-limit flags of ``serve`` that the ingress applies (over the config's ``server``).
LIMIT_FLAGS = ("max_body_bytes", "body_read_timeout_s", "header_read_timeout_s",
               "keep_alive_timeout_s", "max_connections", "tokenizer_threads")


@dataclass(frozen=True)
class IngressSettings:
    """What the ingress replica needs besides the engine handle (picklable)."""

    routing: RoutingConfig = field(default_factory=RoutingConfig)
    served_model_name: Optional[str] = None
    gateway_config: Optional[str] = None
    limit_overrides: dict[str, Any] = field(default_factory=dict)
    responses_store: str = ":memory:"
    responses_ttl: float = 30 * 24 * 3600.0
    tool_call_parser: str = "auto"
    reasoning_parser: str = "auto"
    abort_timeout_s: float = 10.0


def routing_config(args: argparse.Namespace) -> RoutingConfig:
    """The policy flags of ``serve-ray`` (same names and meaning as ``llmserve router``)."""
    return RoutingConfig(policy=args.routing, affinity_blocks=args.affinity_blocks,
                         balance_abs_tokens=args.balance_abs_tokens,
                         balance_rel=args.balance_rel, max_waiting=args.max_waiting)


def ingress_settings(args: argparse.Namespace) -> IngressSettings:
    return IngressSettings(
        routing=routing_config(args), served_model_name=args.served_model_name,
        gateway_config=os.path.abspath(args.config) if args.config else None,
        limit_overrides={name: getattr(args, name, None) for name in LIMIT_FLAGS},
        responses_store=args.responses_store, responses_ttl=args.responses_ttl,
        tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser)


def _uses_gpu(args: argparse.Namespace) -> bool:
    return str(args.device).startswith("cuda")


def replica_resources(args: argparse.Namespace) -> tuple[float, float]:
    """(CPUs, GPUs) that one engine replica (one tensor-parallel rank) reserves."""
    gpus = args.replica_gpus if args.replica_gpus is not None else (
        1.0 if _uses_gpu(args) else 0.0)
    cpus = args.replica_cpus if args.replica_cpus is not None else 1.0
    if cpus < 0 or gpus < 0:
        raise ValueError("--replica-cpus and --replica-gpus must be >= 0")
    return float(cpus), float(gpus)


def engine_deployment_options(args: argparse.Namespace, router_class: Any,
                              stats_period_s: float) -> dict[str, Any]:
    """``serve.deployment`` options of the engine replicas (module docstring).

    With ``--min-replicas``/``--max-replicas`` the deployment autoscales on Ray Serve's
    ongoing requests per replica (queued at the handles plus running in the replica,
    i.e. the engine's waiting + running requests), aiming at ``--target-ongoing-requests``;
    ``--num-replicas`` is then the initial count. With ``--tensor-parallel-size N > 1`` a
    replica's N ranks are processes it spawns on its own node, so the replica gets a
    ``STRICT_PACK`` placement group of N bundles (rank 0 is the replica actor itself).
    """
    if args.num_replicas < 1:
        raise ValueError("--num-replicas must be at least 1")
    if args.max_ongoing_requests < 1:
        raise ValueError("--max-ongoing-requests must be at least 1")
    cpus, gpus = replica_resources(args)
    options: dict[str, Any] = {"name": ENGINE_DEPLOYMENT,
                               "max_ongoing_requests": args.max_ongoing_requests,
                               "health_check_period_s": 5.0,
                               "health_check_timeout_s": 30.0}
    autoscale = args.min_replicas is not None or args.max_replicas is not None
    if autoscale:
        low = args.min_replicas if args.min_replicas is not None else 1
        high = args.max_replicas if args.max_replicas is not None else max(low, args.num_replicas)
        if not 0 <= low <= args.num_replicas <= high or high < 1:
            raise ValueError("need 0 <= --min-replicas <= --num-replicas <= --max-replicas "
                             f"(got {low}, {args.num_replicas}, {high})")
        if args.target_ongoing_requests <= 0:
            raise ValueError("--target-ongoing-requests must be > 0")
        options["autoscaling_config"] = {
            "min_replicas": low, "max_replicas": high, "initial_replicas": args.num_replicas,
            "target_ongoing_requests": args.target_ongoing_requests,
            "upscale_delay_s": args.upscale_delay, "downscale_delay_s": args.downscale_delay}
    else:
        options["num_replicas"] = args.num_replicas
    rank = {"CPU": cpus, **({"GPU": gpus} if gpus else {})}
    if args.tensor_parallel_size > 1:
        options["placement_group_bundles"] = [dict(rank) for _ in range(args.tensor_parallel_size)]
        options["placement_group_strategy"] = "STRICT_PACK"
    options["ray_actor_options"] = {"num_cpus": cpus, "num_gpus": gpus}
    options["request_router_config"] = {
        "request_router_class": router_class,
        "request_router_kwargs": dataclasses.asdict(routing_config(args)),
        "request_routing_stats_period_s": stats_period_s,
        "request_routing_stats_timeout_s": max(5.0, 4 * stats_period_s)}
    return options


def namespace_from_mapping(values: Mapping[str, Any],
                           parser_factory: Callable[[], argparse.ArgumentParser]
                           ) -> argparse.Namespace:
    """Parse ``{"num_replicas": 2, "model": "/m", "enforce_eager": True}`` as the flags
    ``--num-replicas 2 --model /m --enforce-eager`` of ``serve-ray``.

    A key is a flag's name (``_`` or ``-``) or its destination (``enable_prefix_caching``,
    whose ``False`` is ``--no-prefix-caching``). A switch is given by the value it stores;
    ``None`` leaves the default; a list repeats the flag. Unknown keys are a ValueError.
    """
    parser = parser_factory()
    actions: dict[str, argparse.Action] = {}
    for each in parser._actions:  # noqa: SLF001 - argparse has no public list of actions
        if each.option_strings:
            actions.setdefault(each.dest, each)
            for opt in each.option_strings:
                actions[opt[2:].replace("-", "_")] = each
    argv: list[str] = []
    for key, value in values.items():
        found = actions.get(str(key).replace("-", "_"))
        if found is None:
            raise ValueError(f"unknown serve-ray option {key!r}")
        action = found
        if value is None:
            continue
        flag = action.option_strings[0]
        if action.nargs == 0:   # a switch: store_true / store_false / store_const
            if value == action.const:
                argv.append(flag)
        elif isinstance(value, (list, tuple)):
            for item in value:
                argv += [flag, str(item)]
        else:
            argv += [flag, str(value)]
    try:
        return parser.parse_args(argv)
    except SystemExit as exc:   # argparse already printed why
        raise ValueError(f"bad serve-ray options {dict(values)!r}") from exc
