"""RouterEngine: an ``EngineClient`` over several engine replicas (no torch).

The HTTP server and the gateway treat it as one engine, so authentication, rate limits,
admission, idempotency and billing run once, at the front, whatever replica serves the
request. Per request it picks a replica (:mod:`llmserve.router.policy`), streams the
increments back and, when the replica fails before anything was streamed (refused or
broken connection, engine dead, ejected), retries **once** on another admitted replica:
nothing reached the client and no ledger row exists yet (the gateway bills from the
final output, which the failed attempt never produced).

``get_stats`` sums the replicas' last polled stats, so the server's engine gauges and
prefix-cache counters describe the fleet; per-replica series and the router's decision
counters are exported by :mod:`llmserve.router.metrics`.
"""
from __future__ import annotations

import itertools
import logging
from typing import Any, AsyncIterator, Optional, Sequence

from llmserve.protocol import EngineStats, RequestFailedError, RequestOutput
from llmserve.router.policy import RoutingConfig, affinity_key, choose_replica
from llmserve.router.replica_client import ReplicaClient, ReplicaUnavailable
from llmserve.router.replica_header import note_replica
from llmserve.router.replica_set import Replica, ReplicaSet
from llmserve.router.wire import CutShortOutputs, sum_stats
from llmserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def _unavailable(message: str) -> Exception:
    """A 503 for the client: no replica could start the request (nothing was streamed)."""
    from llmserve.contract.errors import OpenAIError

    return OpenAIError(503, message, code="engine_unavailable", headers={"Retry-After": "1"})


class RouterEngine:
    """Routes ``generate`` calls over replicas; see the module docstring."""

    def __init__(self, replica_set: ReplicaSet, info: dict[str, Any],
                 routing: Optional[RoutingConfig] = None, max_retries: int = 1) -> None:
        self.replicas = replica_set
        self.routing = routing or RoutingConfig()
        self.model_name: str = info["model_name"]
        self.fingerprint: str = info["fingerprint"]
        self.max_model_len: int = int(info["max_model_len"])
        self.block_size: int = int(info["block_size"])
        self.tokenizer = info["tokenizer"]
        self.max_retries = max_retries
        self._rr = itertools.count()
        self._where: dict[str, Replica] = {}   # caller's request id -> replica serving it
        self._cut_short = CutShortOutputs()  # final outputs of streams cut short
        # closed before they finished, until the caller's abort() collects them

    @classmethod
    def connect(cls, urls: Sequence[str], *, token: Optional[str] = None,
                routing: Optional[RoutingConfig] = None, **replica_set_kwargs: Any
                ) -> "RouterEngine":
        """Fetch every replica's info (they must serve the same engine fingerprint),
        start the health thread and return the router."""
        if not urls:
            raise ValueError("give at least one --backend URL")
        clients = [ReplicaClient(u, token) for u in urls]
        infos = [c.fetch_info() for c in clients]
        prints = {i["fingerprint"] for i in infos}
        if len(prints) != 1:
            raise ValueError("replicas serve different engines (fingerprints "
                             f"{sorted(p[:12] for p in prints)}); a router needs identical ones")
        replicas = [Replica(f"r{i}", c) for i, c in enumerate(clients)]
        routing = routing or RoutingConfig()
        rs = ReplicaSet(replicas, virtual_nodes=routing.virtual_nodes, **replica_set_kwargs)
        router = cls(rs, infos[0], routing)
        rs.poll_now()   # stats before the first request (the gateway sizes queues from them)
        rs.start()
        return router

    # ---- EngineClient ---------------------------------------------------------------------
    def is_ready(self) -> bool:
        """True while at least one replica is admitted."""
        return bool(self.replicas.admitted())

    def get_stats(self) -> EngineStats:
        with self.replicas.lock:
            return sum_stats([r.stats for r in self.replicas.replicas])

    def _pick(self, prompt: Sequence[int], cache_salt: Optional[str],
              exclude: set[str]) -> Optional[Replica]:
        candidates = [r for r in self.replicas.admitted() if r.name not in exclude]
        if not candidates:
            return None
        key = None
        if self.routing.policy == "prefix":
            key = affinity_key(prompt, self.fingerprint, cache_salt, self.block_size,
                               self.routing.affinity_blocks)
        with self.replicas.lock:
            loads = [r.load() for r in candidates]
        name, decision = choose_replica(loads, self.replicas.ring, key, self.routing,
                                        next(self._rr))
        replica = self.replicas.by_name[name]
        with self.replicas.lock:
            replica.decisions[decision] += 1
        return replica

    async def generate(self, prompt: Any, params: SamplingParams, request_id: str, *,
                       priority: Any = None, cache_salt: Optional[str] = None,
                       deadline: Optional[float] = None,
                       queue_deadline: Optional[float] = None,
                       prediction: Optional[str] = None) -> AsyncIterator[RequestOutput]:
        """Stream the request from the chosen replica (retried once elsewhere when that
        replica fails before the first increment)."""
        if isinstance(prompt, str):
            prompt = self.tokenizer.encode(prompt)
        tried: set[str] = set()
        while True:
            replica = self._pick(prompt, cache_salt, tried)
            if replica is None:
                raise _unavailable("no engine replica is available" + (
                    " (the request failed on " + ", ".join(sorted(tried)) + ")" if tried else ""))
            tried.add(replica.name)
            note_replica(replica.name)   # the x-llmserve-replica response header
            budget = _OutstandingTokens(replica, self.replicas, len(prompt),
                                        (params.max_tokens or self.max_model_len) * params.n)
            self._where[request_id] = replica
            streamed = ended = False
            stream = replica.client.generate(
                prompt, params, request_id, priority=priority, cache_salt=cache_salt,
                deadline=deadline, queue_deadline=queue_deadline, prediction=prediction,
                is_healthy=replica.is_admitted)
            try:
                async for out in stream:
                    streamed = True
                    budget.consume(out)
                    ended = out.finished
                    yield out
                ended = True
                return
            except (ValueError, RequestFailedError):
                ended = True   # the request's own failure: the replica already ended it
                raise
            except ReplicaUnavailable as exc:
                ended = True
                self.replicas.record(replica, ok=False, reason=str(exc), eject_now=True)
                if streamed:
                    raise
                if len(tried) > self.max_retries:
                    raise _unavailable(f"the request failed on {len(tried)} replicas; "
                                       f"last: {exc}") from exc
                with self.replicas.lock:
                    replica.retries_from += 1
                logger.warning("request %s failed on %s before its first token (%s); "
                               "retrying on another replica", request_id, replica.name, exc)
            finally:
                budget.release()
                if not ended:   # cut short by the caller: abort while the stream still lives
                    await self._abort_cut_short(replica, request_id)
                await stream.aclose()
                if self._where.get(request_id) is replica:
                    del self._where[request_id]

    async def _abort_cut_short(self, replica: Replica, request_id: str) -> None:
        """Abort a request whose caller went away and keep its final output (its KV is
        free by then) for the caller's :meth:`abort`, which bills from it."""
        await self._cut_short.abort_and_keep(request_id, replica.client.abort(request_id),
                                             10.0)

    async def abort(self, request_id: str) -> Optional[RequestOutput]:
        """Abort on the replica serving ``request_id``; its final output, or None."""
        if request_id in self._cut_short:
            return self._cut_short.pop(request_id)
        replica = self._where.get(request_id)
        if replica is None:
            return None
        return await replica.client.abort(request_id)

    def shutdown(self) -> None:
        """Stop the health thread (the replicas' processes are their owner's business)."""
        self.replicas.stop()

    def metrics_collector(self) -> Any:
        """A Prometheus collector of the per-replica series and router decisions."""
        from llmserve.router.metrics import RouterCollector

        return RouterCollector(self.replicas)


class _OutstandingTokens:
    """A request's share of its replica's outstanding tokens: its prompt until the first
    increment, then its output tokens still to come."""

    def __init__(self, replica: Replica, replica_set: ReplicaSet, prompt_tokens: int,
                 output_tokens: int) -> None:
        self._replica, self._lock = replica, replica_set.lock
        self._prompt, self._left = prompt_tokens, output_tokens
        self._seen = 0
        with self._lock:
            replica.outstanding_tokens += prompt_tokens + output_tokens
            replica.requests += 1

    def consume(self, out: RequestOutput) -> None:
        done = sum(len(c.token_ids) for c in out.outputs)
        with self._lock:
            drop = self._prompt + min(done, self._left)
            self._replica.outstanding_tokens -= drop
            self._prompt, self._left = 0, self._left - min(done, self._left)

    def release(self) -> None:
        with self._lock:
            self._replica.outstanding_tokens -= self._prompt + self._left
            self._prompt = self._left = 0
