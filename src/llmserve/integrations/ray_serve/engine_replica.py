"""One engine replica of a Ray Serve application: an AsyncLLM in a Ray actor.

It serves no OpenAI API, no gateway and no billing (the ingress does all that once); its
methods mirror the internal API of ``llmserve engine`` (:mod:`llmserve.router.engine_service`)
and speak the router's wire format (:mod:`llmserve.router.wire`), so token ids, sampling
parameters and increments cross the Ray boundary as plain dicts:

* ``info()``: model name, fingerprint, context, block size, tokenizer, stats, replica name;
* ``generate(body, *, affinity_key, cost_tokens)``: a stream whose first event is
  ``{"replica": name}`` (the ingress learns who serves before any token), then
  ``{"output": ...}`` increments, or a last ``{"error": ...}``; closing or cancelling the
  stream aborts the request in the engine. ``affinity_key`` and ``cost_tokens`` are read
  by the request router (:mod:`.request_router`), not here;
* ``abort(request_id, *, target_replica)``: abort here (the router sends it to
  ``target_replica``, the one serving the request) and return the final output;
* ``record_routing_stats()`` / ``check_health()``: Ray Serve's hooks; the stats reach every
  handle's request router and, through it, the ingress's ``/metrics``.
"""
from __future__ import annotations

import logging
from typing import Any, AsyncIterator, Optional

from llmserve.config import EngineConfig
from llmserve.router.wire import (
    error_to_dict,
    output_to_dict,
    params_from_dict,
    stats_to_dict,
    tokenizer_to_dict,
)

logger = logging.getLogger(__name__)


def _replica_name() -> str:
    """This Ray Serve replica's unique id (the ``x-llmserve-replica`` value)."""
    from ray import serve

    return str(serve.get_replica_context().replica_id.unique_id)


class EngineReplica:
    """The body of the engine deployment (decorated with ``serve.deployment`` by the app)."""

    def __init__(self, config: EngineConfig) -> None:
        from llmserve.async_llm import AsyncLLM

        self.engine = AsyncLLM.from_config(config)   # blocks until the model is loaded
        self.name = _replica_name()
        logger.info("llmserve engine replica %s ready (%s)", self.name, self.engine.model_name)

    async def info(self) -> dict[str, Any]:
        engine = self.engine
        return {"replica": self.name, "model_name": engine.model_name,
                "fingerprint": engine.fingerprint, "max_model_len": engine.max_model_len,
                "block_size": engine.block_size, "tokenizer": tokenizer_to_dict(engine.tokenizer),
                "stats": stats_to_dict(engine.get_stats())}

    async def generate(self, body: dict[str, Any], *, affinity_key: Optional[int] = None,
                       cost_tokens: int = 0) -> AsyncIterator[dict[str, Any]]:
        """Stream the request's events (module docstring)."""
        yield {"replica": self.name}
        stream: Any = None   # the engine's async generator
        try:
            extra = {"prediction": body["prediction"]} if body.get("prediction") else {}
            stream = self.engine.generate(
                list(body["prompt"]), params_from_dict(body["params"]), str(body["request_id"]),
                priority=body.get("priority"), cache_salt=body.get("cache_salt"),
                deadline=body.get("deadline"), queue_deadline=body.get("queue_deadline"),
                **extra)
            async for out in stream:
                yield {"output": output_to_dict(out, with_prompt=False)}
        except Exception as exc:  # noqa: BLE001 - every failure goes to the ingress as an event
            if not isinstance(exc, ValueError):
                logger.warning("request %s failed in the engine: %r", body.get("request_id"), exc)
            yield {"error": error_to_dict(exc)}
        finally:
            if stream is not None:
                await stream.aclose()

    async def abort(self, request_id: str, *,
                    target_replica: Optional[str] = None) -> Optional[dict[str, Any]]:
        final = await self.engine.abort(request_id)
        return output_to_dict(final) if final is not None else None

    def record_routing_stats(self) -> dict[str, Any]:
        """Ray Serve polls this; the request router reads it as ``replica.routing_stats``."""
        return {"stats": stats_to_dict(self.engine.get_stats()), "ready": self.engine.is_ready()}

    def check_health(self) -> None:
        """Ray Serve restarts a replica whose engine died (a TP rank lost, the loop crashed)."""
        if not self.engine.is_ready():
            raise RuntimeError(f"llmserve engine of replica {self.name} is not ready")

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
