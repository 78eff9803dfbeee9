"""RayEngineClient: an ``EngineClient`` over the engine deployment's replicas (no torch).

The ingress serves the OpenAI app (and the gateway) over this client exactly as the
router front of ``serve --data-parallel-size`` does over :class:`RouterEngine`: the server
tokenizes and renders chat templates here, the client computes the prompt's affinity key
with the router's own function and calls ``generate`` on the deployment handle; Ray Serve
picks the replica with :class:`~.request_router.LlmserveRequestRouter`. The first event of
every stream names the replica (``x-llmserve-replica`` through
:func:`llmserve.router.replica_header.note_replica`), before any token reaches the client.

Failures: an engine error event maps back to the exception an in-process engine raises
(ValueError, RequestFailedError); a replica that dies or cannot be reached before the
first increment is retried **once** (Ray Serve picks another replica; nothing was streamed
and no ledger row exists); after that, or once streaming started, the client gets a 503
``engine_unavailable``. A stream cut short by the caller is aborted on its replica (the
abort is routed there by ``target_replica``) and its final output kept for ``abort()``,
which the server bills from.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncGenerator, AsyncIterator, Optional, Sequence, Union

from llmserve.protocol import EngineStats, RequestOutput
from llmserve.router.policy import RoutingConfig, affinity_key
from llmserve.router.replica_header import note_replica
from llmserve.router.wire import (
    CutShortOutputs,
    error_from_event,
    output_from_dict,
    params_to_dict,
    stats_from_dict,
    sum_stats,
    tokenizer_from_dict,
)
from llmserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def _unavailable(message: str) -> Exception:
    from llmserve.contract.errors import OpenAIError

    return OpenAIError(503, message, code="engine_unavailable", headers={"Retry-After": "1"})


class ReplicaLost(RuntimeError):
    """The replica could not run (or finish) the request: it died, was unreachable, or
    reported an engine failure."""


def _error_from_event(err: dict[str, Any], replica: str) -> BaseException:
    return error_from_event(err, ReplicaLost(
        f"replica {replica}: {err.get('message', 'engine error')}"))


def _replica_errors() -> tuple[type[BaseException], ...]:
    """Ray's exceptions that say a replica (not the request) failed."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

    return (ActorDiedError, ActorUnavailableError, RayActorError, ReplicaLost)


class RayEngineClient:
    """Routes ``generate`` calls over the engine deployment; see the module docstring."""

    def __init__(self, handle: Any, info: dict[str, Any], routing: RoutingConfig,
                 num_replicas: int = 1, abort_timeout_s: float = 10.0,
                 max_retries: int = 1) -> None:
        self._handle = handle
        self.routing = routing
        self.model_name: str = info["model_name"]
        self.fingerprint: str = info["fingerprint"]
        self.max_model_len: int = int(info["max_model_len"])
        self.block_size: int = int(info["block_size"])
        self.tokenizer = tokenizer_from_dict(info["tokenizer"])
        first = stats_from_dict(info.get("stats") or {})
        # until the router has polled the replicas: the first one's stats, once per replica
        self._seed_stats = sum_stats([first] * max(1, num_replicas))
        self._abort_timeout_s = abort_timeout_s
        self.max_retries = max_retries
        self._where: dict[str, str] = {}   # caller's request id -> replica serving it
        self._cut_short = CutShortOutputs()  # final outputs of streams cut short

    @classmethod
    async def connect(cls, handle: Any, routing: RoutingConfig, *, num_replicas: int = 1,
                      abort_timeout_s: float = 10.0) -> "RayEngineClient":
        """Ask one replica for the engine's description (waits for it to be up)."""
        info = await handle.info.remote()
        return cls(handle, info, routing, num_replicas=num_replicas,
                   abort_timeout_s=abort_timeout_s)

    # ---- stats -------------------------------------------------------------------------------
    def replica_stats(self) -> dict[str, EngineStats]:
        """Each replica's last routing stats (empty before the first poll reached us)."""
        from llmserve.integrations.ray_serve.router_registry import replica_stats

        return replica_stats(self._handle.app_name, self._handle.deployment_name) or {}

    def is_ready(self) -> bool:
        return True   # connect() got an answer; Ray Serve keeps unhealthy replicas out

    def get_stats(self) -> EngineStats:
        """Summed over the replicas (the server's engine series describe the fleet)."""
        per_replica = self.replica_stats()
        return sum_stats(list(per_replica.values())) if per_replica else self._seed_stats

    def metrics_collector(self) -> Any:
        """Per-replica series (``llmserve_replica_*{replica}``) and router decisions."""
        from llmserve.integrations.ray_serve.metrics import RayReplicaCollector

        return RayReplicaCollector(self)

    # ---- requests ----------------------------------------------------------------------------
    async def generate(self, prompt: Union[str, list[int]], params: SamplingParams,
                       request_id: str, *, priority: Union[int, str, None] = None,
                       cache_salt: Optional[str] = None, deadline: Optional[float] = None,
                       queue_deadline: Optional[float] = None,
                       prediction: Optional[str] = None) -> AsyncGenerator[RequestOutput, None]:
        """Stream the request from the replica Ray Serve's router picks (retried once when
        the replica fails before the first increment)."""
        prompt = list(self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt)
        key = None
        if self.routing.policy == "prefix":
            key = affinity_key(prompt, self.fingerprint, cache_salt, self.block_size,
                               self.routing.affinity_blocks)
        cost = len(prompt) + (params.max_tokens or self.max_model_len) * params.n
        body = {"request_id": request_id, "prompt": prompt, "params": params_to_dict(params),
                "priority": priority, "cache_salt": cache_salt, "deadline": deadline,
                "queue_deadline": queue_deadline, "prediction": prediction}
        attempts = 0
        while True:
            attempts += 1
            streamed = False
            try:
                async for out in self._stream_once(body, prompt, key, cost):
                    streamed = True
                    yield out
                return
            except _replica_errors() as exc:
                if streamed or attempts > self.max_retries:
                    raise _unavailable(f"the engine replica failed: {exc}") from exc
                logger.warning("request %s failed on a replica before its first token (%s); "
                               "retrying", request_id, exc)

    async def _stream_once(self, body: dict[str, Any], prompt: Sequence[int],
                           key: Optional[int], cost: int) -> AsyncIterator[RequestOutput]:
        request_id = body["request_id"]
        stream = self._handle.options(stream=True).generate.remote(
            body, affinity_key=key, cost_tokens=cost)
        replica: Optional[str] = None
        ended = False
        try:
            async for event in stream:
                if "replica" in event:
                    replica = str(event["replica"])
                    self._where[request_id] = replica
                    note_replica(replica)   # the x-llmserve-replica response header
                    continue
                if "error" in event:
                    ended = True
                    raise _error_from_event(event["error"], replica or "?")
                out = output_from_dict(event["output"], list(prompt))
                ended = out.finished
                yield out
                if ended:
                    return
            ended = True
            raise ReplicaLost(f"replica {replica} ended the stream without a final output")
        finally:
            if not ended and replica is not None:   # cut short by the caller
                await self._abort_cut_short(replica, request_id)
            stream.cancel()
            if self._where.get(request_id) == replica:
                self._where.pop(request_id, None)

    async def _abort_on(self, replica: str, request_id: str) -> Optional[RequestOutput]:
        failures: tuple[type[BaseException], ...] = (asyncio.TimeoutError, *_replica_errors())
        try:
            data = await asyncio.wait_for(
                self._handle.abort.remote(request_id, target_replica=replica),
                self._abort_timeout_s)
        except failures as exc:
            logger.warning("abort of %s on %s failed: %r", request_id, replica, exc)
            return None
        return output_from_dict(data) if data else None

    async def _abort_cut_short(self, replica: str, request_id: str) -> None:
        """Abort a request whose caller went away; keep its final output for abort()."""
        await self._cut_short.abort_and_keep(request_id, self._abort_on(replica, request_id))

    async def abort(self, request_id: str) -> Optional[RequestOutput]:
        """Abort on the replica serving ``request_id``; its final output, or None."""
        if request_id in self._cut_short:
            return self._cut_short.pop(request_id)
        replica = self._where.get(request_id)
        if replica is None:
            return None
        return await self._abort_on(replica, request_id)

    def shutdown(self) -> None:
        """Nothing to stop: Ray Serve owns the replicas."""
