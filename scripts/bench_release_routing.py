"""Gateway overhead of release routing: the same requests for a public model (a release
with a 50 % canary and per-request health bookkeeping) and for its target directly,
side by side on one server over fake engines (no model work), rounds interleaved.

    PYTHONPATH=src:. python scripts/bench_release_routing.py [--requests 300] [--rounds 3]

Prints requests/s of each and their ratio (median over rounds). The fake engine makes
the gateway path the cost being measured; the machine is shared and noisy.
"""
from __future__ import annotations

import argparse
import statistics
import time
import uuid

import httpx

from llmserve.gateway import hash_api_key
from llmserve.gateway.config.gateway_config import GatewayConfig
from llmserve.gateway.hook import TenantGateway
from tests.server.conftest import LiveServer
from tests.server.server_fakes import FakeEngine


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    key = "sk-" + uuid.uuid4().hex
    config = GatewayConfig.from_dict({
        "tenants": {"t": {"keys": [hash_api_key(key)]}},
        "releases": {"chat": {"stable": "v1", "canary": {"release": "v2", "share": 0.5},
                              "health": {"max_error_rate": 0.5, "max_ttft_p95_s": 10},
                              "versions": {"v1": {"target": "a"}, "v2": {"target": "b"}}}}})
    a = FakeEngine(model_name="a", token_delay=0.0)
    b = FakeEngine(model_name="b", token_delay=0.0)
    live = LiveServer(a, served_model_names=["a"], engines={"b": b},
                      gateway=TenantGateway(config, {"a": a, "b": b})).start()
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    rates: dict[str, list[float]] = {"chat": [], "a": []}
    try:
        with httpx.Client(headers={"Authorization": f"Bearer {key}"}, timeout=30) as client:
            for _ in range(args.rounds):
                for model in ("chat", "a"):
                    start = time.perf_counter()
                    for _ in range(args.requests):
                        r = client.post(live.url("/v1/chat/completions"),
                                        json=dict(body, model=model))
                        r.raise_for_status()
                    rates[model].append(args.requests / (time.perf_counter() - start))
    finally:
        live.stop()
    release, direct = statistics.median(rates["chat"]), statistics.median(rates["a"])
    print(f"release routing: {release:.0f} req/s; direct: {direct:.0f} req/s; "
          f"ratio {release / direct:.3f} (median of {args.rounds} rounds x {args.requests})")


if __name__ == "__main__":
    main()
