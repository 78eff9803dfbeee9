"""llmserve's routing policy as a Ray Serve custom request router.

Ray Serve (2.60) lets a deployment name a :class:`ray.serve.request_router.RequestRouter`
subclass; every handle to the deployment (here: the ingress's) routes through an instance
of it. :class:`LlmserveRequestRouter` ranks the candidate replicas with llmserve's own
policy (:func:`llmserve.router.policy.choose_replica`), the one ``llmserve router`` uses:

* ``prefix``: the request's **affinity key** (the prefix cache's chained block hash of the
  prompt's first blocks, rooted in the engine fingerprint and the tenant's cache salt;
  computed by the ingress and passed as the ``affinity_key`` keyword of ``generate``) is
  placed on a consistent-hash ring over the replicas' ids; the owner is preferred unless
  it is overloaded against the least loaded one (outstanding tokens, queue, free KV);
* ``round-robin`` and ``least-loaded`` as in ``llmserve router``.

The chosen replica is the first rank and the others, least loaded first, the second:
Ray Serve sends to the first rank unless its queue is at ``max_ongoing_requests``, then
tries the next. A call with a ``target_replica`` keyword (the ingress's abort) goes to
that replica only.

Load: outstanding tokens (prompt + ``max_tokens`` of the requests this router sent and
that have not completed; ``cost_tokens``) are kept here; queue depth and free KV blocks
come from each replica's ``record_routing_stats`` (Ray Serve polls it every
``request_routing_stats_period_s`` and hands it to every router). The same stats make the
ingress's engine gauges and prefix-cache counters (:mod:`.router_registry`; Ray Serve
pickles this module by value, so it keeps no state of its own at module level).
"""
from __future__ import annotations

import itertools
import logging
import threading
from typing import Any, Optional

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from llmserve.integrations.ray_serve.router_registry import register
from llmserve.protocol import EngineStats
from llmserve.router.policy import HashRing, ReplicaLoad, RoutingConfig, choose_replica, least_loaded
from llmserve.router.replica_set import DECISIONS
from llmserve.router.wire import stats_from_dict

logger = logging.getLogger(__name__)

class LlmserveRequestRouter(RequestRouter):
    """llmserve's replica choice inside Ray Serve (module docstring)."""

    def initialize_state(self, **kwargs: Any) -> None:
        """Called by Ray Serve with the deployment's ``request_router_kwargs``: the fields
        of :class:`RoutingConfig`."""
        self.config = RoutingConfig(**kwargs)
        self._rr = itertools.count()
        self._ring_names: tuple[str, ...] = ()
        self._ring = HashRing([], self.config.virtual_nodes)
        self._lock = threading.Lock()
        self._outstanding: dict[str, int] = {}
        self._by_request: dict[str, tuple[str, int]] = {}
        self._decisions: dict[str, dict[str, int]] = {}
        register(self._deployment_id.app_name, self._deployment_id.name, self)

    # ---- what the ingress reads -----------------------------------------------------------
    def stats_by_replica(self) -> dict[str, EngineStats]:
        out = {}
        for replica in list(self.curr_replicas.values()):
            raw = (replica.routing_stats or {}).get("stats")
            if raw:
                out[replica.replica_id.unique_id] = stats_from_dict(raw)
        return out

    def decisions_by_replica(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return {name: dict(d) for name, d in self._decisions.items()}

    # ---- the policy ------------------------------------------------------------------------
    def _ring_over(self, names: list[str]) -> HashRing:
        key = tuple(sorted(names))
        if key != self._ring_names:
            self._ring_names, self._ring = key, HashRing(key, self.config.virtual_nodes)
        return self._ring

    def _load(self, replica: RunningReplica) -> ReplicaLoad:
        name = replica.replica_id.unique_id
        stats = stats_from_dict((replica.routing_stats or {}).get("stats") or {})
        total = stats.kv_blocks_total
        with self._lock:
            outstanding = self._outstanding.get(name, 0)
        return ReplicaLoad(name, outstanding, stats.num_waiting,
                           max(0, total - stats.kv_blocks_used), total)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: Optional[PendingRequest] = None
                              ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True   # no busy loop when full
        if not candidate_replicas:
            return []
        kwargs = pending_request.kwargs if pending_request is not None else {}
        target = kwargs.get("target_replica")
        if target is not None:
            return [[r for r in candidate_replicas if r.replica_id.unique_id == target]]
        by_name = {r.replica_id.unique_id: r for r in candidate_replicas}
        loads = [self._load(r) for r in candidate_replicas]
        ring = self._ring_over(list(by_name))
        name, decision = choose_replica(loads, ring, kwargs.get("affinity_key"), self.config,
                                        next(self._rr))
        with self._lock:
            counts = self._decisions.setdefault(name, dict.fromkeys(DECISIONS, 0))
            counts[decision] += 1
        rest = [load for load in loads if load.name != name]
        ordered = []
        while rest:
            best = least_loaded(rest)
            ordered.append(by_name[best.name])
            rest.remove(best)
        return [[by_name[name]], ordered] if ordered else [[by_name[name]]]

    # ---- outstanding tokens ----------------------------------------------------------------
    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: Any) -> None:
        cost = int(pending_request.kwargs.get("cost_tokens") or 0)
        if not cost:
            return
        name = replica_id.unique_id
        with self._lock:
            self._outstanding[name] = self._outstanding.get(name, 0) + cost
            self._by_request[pending_request.metadata.internal_request_id] = (name, cost)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        with self._lock:
            entry = self._by_request.pop(internal_request_id, None)
            if entry is not None:
                name, cost = entry
                self._outstanding[name] = max(0, self._outstanding.get(name, 0) - cost)
