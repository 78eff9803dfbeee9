"""The routing rules on their own: affinity keys, the ring, the overload thresholds, wire."""
from __future__ import annotations

import json

import pytest

from llmserve.protocol import CompletionOutput, EngineStats, RequestMetrics, RequestOutput
from llmserve.router.policy import HashRing, ReplicaLoad, RoutingConfig, affinity_key, choose_replica
from llmserve.router.wire import output_from_dict, output_to_dict, params_from_dict, params_to_dict, sum_stats
from llmserve.sampling_params import SamplingParams

FP = "fp-test"


def test_affinity_key_follows_the_prefix_cache_namespace():
    prefix = list(range(64))
    a = affinity_key(prefix + [1, 2, 3], FP, None, 16, 4)
    b = affinity_key(prefix + [9, 9, 9, 9, 9], FP, None, 16, 4)
    assert a == b                                        # same first 4 blocks
    assert affinity_key(prefix, FP, "tenant-x", 16, 4) != a   # another tenant's namespace
    assert affinity_key(prefix, "other-engine", None, 16, 4) != a
    assert affinity_key([5] + prefix, FP, None, 16, 4) != a
    assert affinity_key([1, 2], FP, None, 16, 4) != affinity_key([1, 3], FP, None, 16, 4)


def test_ring_moves_only_the_removed_replicas_keys():
    full = HashRing(["r0", "r1", "r2"], 64)
    keys = [affinity_key([i] * 20, FP, None, 16, 1) for i in range(400)]
    owners = {k: full.lookup(k) for k in keys}
    assert {"r0", "r1", "r2"} == set(owners.values())
    reduced = HashRing(["r0", "r2"], 64)
    for k, owner in owners.items():
        if owner != "r1":
            assert reduced.lookup(k) == owner


def test_choose_prefers_affinity_until_overloaded():
    ring = HashRing(["r0", "r1"], 64)
    key = next(k for k in (affinity_key([i], FP, None, 16, 1) for i in range(100))
               if ring.lookup(k) == "r0")
    cfg = RoutingConfig(balance_abs_tokens=1000, balance_rel=1.5, max_waiting=4)
    calm = [ReplicaLoad("r0", 900), ReplicaLoad("r1", 0)]
    assert choose_replica(calm, ring, key, cfg, 0) == ("r0", "affinity")
    busy = [ReplicaLoad("r0", 1500), ReplicaLoad("r1", 100)]
    assert choose_replica(busy, ring, key, cfg, 0) == ("r1", "fallback")
    queued = [ReplicaLoad("r0", 0, num_waiting=5), ReplicaLoad("r1", 0)]
    assert choose_replica(queued, ring, key, cfg, 0) == ("r1", "fallback")
    full_kv = [ReplicaLoad("r0", 0, kv_blocks_free=1, kv_blocks_total=100),
               ReplicaLoad("r1", 10, kv_blocks_free=50, kv_blocks_total=100)]
    assert choose_replica(full_kv, ring, key, cfg, 0) == ("r1", "fallback")
    rr = RoutingConfig(policy="round-robin")
    assert [choose_replica(calm, ring, key, rr, i)[0] for i in range(4)] == ["r0", "r1"] * 2
    with pytest.raises(ValueError, match="routing policy"):
        RoutingConfig(policy="random")


def test_wire_round_trip_and_fleet_sum():
    params = SamplingParams(n=2, temperature=0.5, stop=["x", "y"], seed=3, max_tokens=7)
    assert params_from_dict(params_to_dict(params)) == params
    from llmserve.structured_output.reasoning_budget import ReasoningBudget

    thinking = SamplingParams(reasoning_budget=ReasoningBudget(5, (7, 8), (6,)))
    assert params_from_dict(json.loads(json.dumps(params_to_dict(thinking)))) == thinking
    with pytest.raises(ValueError, match="unknown sampling"):
        params_from_dict({"warp": 9})
    out = RequestOutput("r", None, [1, 2], [CompletionOutput(1, "hi", [5], "stop", 2, None, 3)],
                        finished=True, num_cached_tokens=16,
                        metrics=RequestMetrics(1.0, 2.0, 3.0, 4.0, 5.0))
    assert output_from_dict(output_to_dict(out)) == out
    total = sum_stats([EngineStats(num_running=1, prefix_hit_tokens=10,
                                   prefix_hit_tokens_by_tenant={"a": 10}, kv_bytes_per_token=8),
                       EngineStats(num_running=2, prefix_hit_tokens=5,
                                   prefix_hit_tokens_by_tenant={"a": 1, "b": 4},
                                   kv_bytes_per_token=8)])
    assert (total.num_running, total.prefix_hit_tokens, total.kv_bytes_per_token) == (3, 15, 8)
    assert total.prefix_hit_tokens_by_tenant == {"a": 11, "b": 4}
