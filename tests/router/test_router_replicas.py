"""A router front over two real `llmserve engine` processes (tiny random Llama).

Order matters: the last test kills a replica. Each test builds its own front (an
in-process uvicorn server over a RouterEngine) on the same two engine processes and uses
fresh random prefixes, so earlier tests' cached blocks do not help it.
"""
from __future__ import annotations

import asyncio
import os
import random
import signal
import threading
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from llmserve.gateway.hook import build_gateway
from llmserve.router.engine_processes import EngineProcesses
from llmserve.router.policy import RoutingConfig, affinity_key
from llmserve.router.router_engine import RouterEngine
from llmserve.sampling_params import SamplingParams
from tests.gateway.gateway_server_helpers import auth, ledger_rows, write_config
from tests.model.tiny_checkpoints import make_tiny_checkpoint
from tests.server.conftest import LiveServer
from tests.server.server_helpers import metric_value, wait_until

SRC = str(Path(__file__).resolve().parents[2] / "src")
ROOT = str(Path(__file__).resolve().parents[2])


@pytest.fixture(scope="module")
def engines(tmp_path_factory) -> Iterator[EngineProcesses]:
    model = make_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny") / "m"), arch="llama")
    procs = EngineProcesses(
        2, ["--model", model, "--dtype", "float32", "--num-kv-blocks", "128",
            "--max-model-len", "512", "--num-threads", "1"],
        log_dir=str(tmp_path_factory.mktemp("logs")),
        extra_env={"PYTHONPATH": os.pathsep.join([SRC, ROOT, os.environ.get("PYTHONPATH", "")])})
    try:
        procs.start(ready_timeout_s=180)
        yield procs
    finally:
        procs.stop()
    assert all(p.poll() is not None for p in procs.procs)


def _front(engines: EngineProcesses, routing: RoutingConfig, **kw) -> tuple[RouterEngine,
                                                                               LiveServer]:
    kw.setdefault("poll_interval_s", 0.2)
    kw.setdefault("poll_timeout_s", 0.5)
    gateway_config = kw.pop("gateway_config", None)
    router = RouterEngine.connect(engines.urls, token=engines.token, routing=routing, **kw)
    gateway = build_gateway(str(gateway_config), router) if gateway_config else None
    return router, LiveServer(router, gateway=gateway).start()


def _complete(live: LiveServer, prompt: list[int], max_tokens: int = 2, **headers) -> dict:
    r = httpx.post(live.url("/v1/completions"), headers=headers, timeout=60, json={
        "model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


def _metric(live: LiveServer, name: str, **labels: str) -> float:
    return metric_value(live.metrics_text(), name, **labels)


def _groups(seed: int, count: int, length: int = 80) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(count)]


def test_prefix_affinity_keeps_groups_together_and_hits_the_cache(engines):
    router, live = _front(engines, RoutingConfig(policy="prefix"))
    rr_router, rr_live = _front(engines, RoutingConfig(policy="round-robin"))
    try:
        results = {}
        for name, front, seed in (("prefix", live, 1), ("round-robin", rr_live, 2)):
            cached = total = 0
            for prefix in _groups(seed, 4):
                for i in range(3):
                    usage = _complete(front, prefix + [7 + i] * 5)["usage"]
                    cached += usage["prompt_tokens_details"]["cached_tokens"]
                    total += usage["prompt_tokens"]
            results[name] = cached / total
        # prefix: each group's 2nd and 3rd requests reuse 80 tokens (5 blocks) of 85
        assert results["prefix"] == pytest.approx(2 * 80 / (3 * 85), abs=1e-9)
        assert results["round-robin"] < results["prefix"]
        owners = {router.replicas.ring.lookup(affinity_key(g, router.fingerprint, None, 16, 4))
                  for g in _groups(1, 4)}
        decisions = {r: _metric(live, "llmserve_router_decisions_total", replica=r,
                                decision="affinity") for r in ("r0", "r1")}
        assert sum(decisions.values()) == 12
        assert {r for r, n in decisions.items() if n} == owners
        assert _metric(rr_live, "llmserve_router_decisions_total", replica="r1",
                       decision="round_robin") == 6
    finally:
        for front, r in ((live, router), (rr_live, rr_router)):
            front.stop()
            r.shutdown()


def test_fallback_to_least_loaded_when_the_preferred_replica_is_busy(engines):
    router, live = _front(engines, RoutingConfig(balance_abs_tokens=0, balance_rel=1.0))
    prefix = _groups(3, 1)[0]
    owner = router.replicas.ring.lookup(affinity_key(prefix, router.fingerprint, None, 16, 4))
    other = "r1" if owner == "r0" else "r0"
    long_run = threading.Thread(target=_complete, args=(live, prefix + [1], 420))
    try:
        long_run.start()
        assert wait_until(lambda: router.replicas.by_name[owner].outstanding_tokens > 0, 10,
                          0.001)
        _complete(live, prefix + [2])   # while the long request runs on the owner
        long_run.join(60)
        assert _metric(live, "llmserve_router_decisions_total", replica=other,
                       decision="fallback") == 1
        assert _metric(live, "llmserve_router_decisions_total", replica=owner,
                       decision="affinity") == 1
    finally:
        live.stop()
        router.shutdown()


def test_abort_reaches_the_replica_and_frees_its_kv(engines):
    router, live = _front(engines, RoutingConfig())
    params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)

    async def start_then_cancel():
        stream = router.generate(_groups(6, 1)[0], params, "cancel-me")
        first = await stream.__anext__()
        await stream.aclose()                       # the client went away
        return first, await router.abort("cancel-me")

    try:
        first, final = asyncio.run(start_then_cancel())
        assert first.outputs[0].token_ids
        assert final is not None and final.outputs[0].finish_reason == "abort"
        assert final.outputs[0].num_tokens < 400
        assert wait_until(lambda: _metric(live, "llmserve_request_aborted_total") >= 1, 10, 0.1)
        assert wait_until(lambda: _metric(live, "llmserve_num_requests_running") == 0
                          and _metric(live, "llmserve_kv_cache_blocks_used") == 0, 10, 0.1)
    finally:
        live.stop()
        router.shutdown()


def test_ejection_and_readmission_of_a_stalled_replica(engines):
    router, live = _front(engines, RoutingConfig(policy="round-robin"))
    stalled = engines.procs[1]
    try:
        os.kill(stalled.pid, signal.SIGSTOP)
        assert wait_until(lambda: _metric(live, "llmserve_router_replica_admitted",
                                          replica="r1") == 0, 10, 0.1)
        assert httpx.get(live.url("/ready"), timeout=5).status_code == 200
        for prefix in _groups(4, 4, length=20):
            _complete(live, prefix)
        assert _metric(live, "llmserve_router_decisions_total", replica="r0",
                       decision="round_robin") == 4
        os.kill(stalled.pid, signal.SIGCONT)
        assert wait_until(lambda: _metric(live, "llmserve_router_replica_admitted",
                                          replica="r1") == 1, 10, 0.1)
        assert _metric(live, "llmserve_router_ejections_total", replica="r1") == 1
        assert _metric(live, "llmserve_router_readmissions_total", replica="r1") == 1
    finally:
        os.kill(stalled.pid, signal.SIGCONT)
        live.stop()
        router.shutdown()


def test_request_on_a_dead_replica_is_retried_once_and_billed_once(engines, tmp_path):
    config = write_config(tmp_path, {"acme": {}}, {"acme": "sk-acme"}, database="ledger.db")
    # a slow health check: the router only learns of the death from the request itself
    router, live = _front(engines, RoutingConfig(), gateway_config=config,
                          poll_interval_s=60.0)
    victim = engines.procs[1]
    try:
        victim.kill()
        victim.wait(10)
        salt = live.app.state.gateway.config.tenants["acme"].cache_salt   # tenant namespace
        prompt = next(p for p in _groups(5, 50, length=70)
                      if router.replicas.ring.lookup(affinity_key(
                          p, router.fingerprint, salt, 16, 4)) == "r1")
        body = _complete(live, prompt, max_tokens=3, **auth("sk-acme"))
        assert body["usage"]["completion_tokens"] == 3
        assert _metric(live, "llmserve_router_retries_total", replica="r1") == 1
        assert _metric(live, "llmserve_router_replica_admitted", replica="r1") == 0
        rows = ledger_rows(tmp_path / "ledger.db")
        assert len(rows) == 1 and rows[0]["completion_tokens"] == 3
        assert rows[0]["tenant"] == "acme"
    finally:
        live.stop()
        router.shutdown()
