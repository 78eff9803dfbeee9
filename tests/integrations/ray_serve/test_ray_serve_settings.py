"""`serve-ray`'s flags -> Ray Serve deployment options, and the entry points' errors
(no cluster, no Ray needed except where marked)."""
from __future__ import annotations

import argparse
import builtins
import sys
from typing import Any

import pytest

from llmserve.cli import build_parser, main
from llmserve.integrations.ray_serve.cli import INSTALL_HINT, serve_ray_parser
from llmserve.integrations.ray_serve.settings import (
    ENGINE_DEPLOYMENT,
    engine_deployment_options,
    ingress_settings,
    namespace_from_mapping,
)

ROUTER = "llmserve.integrations.ray_serve.request_router:LlmserveRequestRouter"


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve-ray", *argv])


def test_fixed_replicas_and_llmserve_router() -> None:
    args = parse("--num-replicas", "3", "--routing", "round-robin", "--affinity-blocks", "2")
    opts = engine_deployment_options(args, ROUTER, 0.5)
    assert opts["name"] == ENGINE_DEPLOYMENT and opts["num_replicas"] == 3
    assert "autoscaling_config" not in opts and "placement_group_bundles" not in opts
    assert opts["ray_actor_options"] == {"num_cpus": 1.0, "num_gpus": 0.0}
    router = opts["request_router_config"]
    assert router["request_router_class"] == ROUTER
    assert router["request_router_kwargs"]["policy"] == "round-robin"
    assert router["request_router_kwargs"]["affinity_blocks"] == 2
    assert router["request_routing_stats_period_s"] == 0.5


def test_autoscaling_on_ongoing_requests() -> None:
    args = parse("--num-replicas", "2", "--min-replicas", "1", "--max-replicas", "4",
                 "--target-ongoing-requests", "6")
    auto = engine_deployment_options(args, ROUTER, 1.0)["autoscaling_config"]
    assert auto["min_replicas"] == 1 and auto["max_replicas"] == 4
    assert auto["initial_replicas"] == 2 and auto["target_ongoing_requests"] == 6
    with pytest.raises(ValueError, match="min-replicas"):
        engine_deployment_options(parse("--num-replicas", "5", "--max-replicas", "4"),
                                  ROUTER, 1.0)


def test_tensor_parallel_replica_gets_a_packed_placement_group() -> None:
    args = parse("--tensor-parallel-size", "2", "--device", "cuda", "--replica-cpus", "2")
    opts = engine_deployment_options(args, ROUTER, 1.0)
    assert opts["placement_group_bundles"] == [{"CPU": 2.0, "GPU": 1.0}] * 2
    assert opts["placement_group_strategy"] == "STRICT_PACK"
    assert opts["ray_actor_options"] == {"num_cpus": 2.0, "num_gpus": 1.0}


def test_serve_run_args_parse_like_flags() -> None:
    args = namespace_from_mapping({"model": "/m", "num-replicas": "4", "enforce_eager": True,
                                   "config": "gw.yaml", "max_body_bytes": 1000,
                                   "enable_prefix_caching": False}, serve_ray_parser)
    assert args.model == "/m" and args.num_replicas == 4 and args.enforce_eager
    assert args.enable_prefix_caching is False
    settings = ingress_settings(args)
    assert settings.gateway_config is not None and settings.gateway_config.endswith("gw.yaml")
    assert settings.limit_overrides["max_body_bytes"] == 1000
    with pytest.raises(ValueError, match="unknown serve-ray option 'num_replica'"):
        namespace_from_mapping({"num_replica": 2}, serve_ray_parser)
    with pytest.raises(ValueError, match="bad serve-ray options"):
        namespace_from_mapping({"routing": "random"}, serve_ray_parser)


def test_missing_ray_is_a_clear_error(monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    real_import = builtins.__import__

    def no_ray(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "ray" or name.startswith("ray."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    for name in [m for m in sys.modules if m == "ray" or m.startswith("ray.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(builtins, "__import__", no_ray)
    with pytest.raises(SystemExit) as exc:
        main(["serve-ray", "--num-replicas", "2"])
    assert exc.value.code == 2
    assert INSTALL_HINT in capsys.readouterr().err
    from llmserve.integrations.ray_serve import build_app

    with pytest.raises(ValueError, match=r"llmserve\[ray\]"):
        build_app({"num_replicas": 2})


def test_build_app_binds_ingress_over_engine_deployment() -> None:
    """`serve run llmserve.integrations.ray_serve:build_app` builds without a cluster."""
    pytest.importorskip("ray.serve")
    from llmserve.integrations.ray_serve import build_app

    app = build_app({"num_replicas": 2, "routing": "round-robin"}, device="cpu")
    ingress = app._bound_deployment  # noqa: SLF001 - what `serve run` would deploy
    assert ingress.name == "LlmserveIngress"
    engine = ingress.init_args[0]._bound_deployment  # noqa: SLF001
    assert engine.name == ENGINE_DEPLOYMENT and engine.num_replicas == 2
    assert ingress.init_args[1].routing.policy == "round-robin"
