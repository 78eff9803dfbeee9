"""LoRA adapters as served model names, and the endpoints that load and unload them.

    POST /v1/load_lora_adapter     {"lora_name", "lora_path"}  -> 200 {adapter}
    POST /v1/unload_lora_adapter   {"lora_name"}               -> 200 | 404 | 409 (in use)

An adapter is served under its own name: ``{"model": "<lora_name>"}`` runs the base engine
with that adapter. The server keeps a :class:`LoraModelView` per adapter in its served
models (and in the gateway's router, sharing the base model's queue and KV gate), so
everything keyed by the served name -- tenants' ``models`` allow-lists, the response's
``model``, ``/v1/models`` (with ``parent``) -- treats it as a model. The view's
fingerprint covers the adapter's content hash.

With a gateway the two endpoints need an admin key (``admin.keys``); without one they
are open, like the rest of the bare server. Unloading an adapter that queued or running
requests still use answers 409 ``lora_in_use`` (retry once they finished). No torch.
"""
from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any, AsyncGenerator, Optional, Sequence, Union, cast

from llmserve.contract.engine_client import EngineClient, LoraAdmin, LoraEngineClient
from llmserve.contract.errors import OpenAIError
from llmserve.contract.gateway_hook import ExtraRoute, Gateway, HTTPCall
from llmserve.contract.names import NAME_RULE, is_valid_name
from llmserve.lora.registry import LoraError, LoraInUse, LoraNotFound
from llmserve.protocol import RequestOutput
from llmserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from llmserve.server.serving import OpenAIServing

logger = logging.getLogger(__name__)


class LoraModelView:
    """The base engine seen through one adapter: ``generate`` runs under ``lora_name``."""

    def __init__(self, base: Any, parent: str, info: dict[str, Any]) -> None:
        self.base_engine = base   # the engine that runs it (admin operations dedupe on it)
        self.lora_name: str = info["name"]
        self.lora_parent = parent
        self.lora_info = info
        self.fingerprint: str = info["system_fingerprint"]
        self.model_name = base.model_name

    def __getattr__(self, name: str) -> Any:   # tokenizer, max_model_len, abort, stats ...
        return getattr(self.base_engine, name)

    #: embeddings run on the base model only: None keeps the base engine's ``embed`` from
    #: showing through __getattr__ (not an EmbeddingEngine, so /v1/embeddings answers 400
    #: instead of returning the base model's vectors under the adapter's name)
    embed = None

    # Spelled out (not only through __getattr__): from Python 3.12 ``isinstance`` against a
    # runtime-checkable protocol looks attributes up statically, past __getattr__.
    async def pin_prefix(self, pin_id: str, token_ids: Sequence[int], cache_salt: Optional[str],
                         max_blocks: Optional[int] = None) -> int:
        """The base engine's ``pin_prefix`` (contract.PrefixPinning)."""
        return await self.base_engine.pin_prefix(pin_id, token_ids, cache_salt, max_blocks)

    async def unpin_prefix(self, pin_id: str) -> int:
        """The base engine's ``unpin_prefix`` (contract.PrefixPinning)."""
        return await self.base_engine.unpin_prefix(pin_id)

    def generate(self, prompt: Union[str, list[int]], params: SamplingParams, request_id: str,
                 *, priority: Union[int, str, None] = None,
                 cache_salt: Optional[str] = None, deadline: Optional[float] = None,
                 queue_deadline: Optional[float] = None,
                 prediction: Optional[str] = None) -> AsyncGenerator[RequestOutput, None]:
        """The base engine's ``generate`` under this adapter."""
        return self.base_engine.generate(prompt, params, request_id, priority=priority,
                                   cache_salt=cache_salt, deadline=deadline,
                                   queue_deadline=queue_deadline, prediction=prediction,
                                   lora=self.lora_name)


class LoraAdapters:
    """Keeps the served model names in step with the engine's loaded adapters."""

    def __init__(self, serving: OpenAIServing, engine: LoraEngineClient, parent: str,
                 gateway: Optional[Gateway] = None) -> None:
        self.serving = serving
        self.engine = engine
        self.parent = parent
        self.gateway = gateway
        for info in engine.lora_adapters():   # --lora-modules, loaded at start-up
            self._serve(info)

    @staticmethod
    def supported(engine: EngineClient) -> bool:
        """Engines that can load adapters (an engine without ``--max-loras`` answers the
        load endpoint with a 400 that says how to enable LoRA)."""
        return isinstance(engine, LoraAdmin)

    def _serve(self, info: dict[str, Any]) -> None:
        view = LoraModelView(self.engine, self.parent, info)
        self.serving.engines[view.lora_name] = view
        self.serving.served_model_names.append(view.lora_name)
        router = getattr(self.gateway, "router", None)
        if router is not None:
            router.add_alias(view.lora_name, view, self.parent)

    def _unserve(self, name: str) -> None:
        self.serving.engines.pop(name, None)
        if name in self.serving.served_model_names:
            self.serving.served_model_names.remove(name)
        router = getattr(self.gateway, "router", None)
        if router is not None:
            router.remove(name)

    # ---- endpoints ------------------------------------------------------------------
    def _require_admin(self, call: HTTPCall) -> None:
        admin = getattr(self.gateway, "admin", None)
        if self.gateway is None:
            return
        if admin is not None and admin.is_admin(call):
            return
        if not call.headers.get("authorization"):
            raise OpenAIError(401, "Missing API key; send 'Authorization: Bearer <admin key>'",
                              code="missing_api_key")
        raise OpenAIError(403, "loading and unloading LoRA adapters needs an admin key "
                          "(`admin.keys` in the gateway config)",
                          code="admin_key_required")

    @staticmethod
    def _body(call: HTTPCall, fields: tuple[str, ...]) -> list[str]:
        try:
            body = json.loads(call.body or b"{}")
        except ValueError as exc:
            raise OpenAIError(400, f"the body is not valid JSON: {exc}",
                              code="invalid_json") from None
        if not isinstance(body, dict):
            raise OpenAIError(400, "expected a JSON object")
        values = []
        for field in fields:
            value = body.get(field)
            if not isinstance(value, str) or not value:
                raise OpenAIError(400, f"{field} must be a non-empty string", param=field)
            values.append(value)
        return values

    async def load(self, call: HTTPCall) -> tuple[int, Any]:
        self._require_admin(call)
        name, path = self._body(call, ("lora_name", "lora_path"))
        if not is_valid_name(name):
            raise OpenAIError(400, f"lora_name {name!r} is not a valid name: {NAME_RULE}",
                              param="lora_name", code="invalid_lora_name")
        if name in self.serving.engines:
            raise OpenAIError(400, f"the model name {name!r} is already served",
                              param="lora_name", code="lora_name_taken")
        try:
            info = await self.engine.load_lora_adapter(name, path)
        except LoraNotFound as exc:
            raise OpenAIError(404, str(exc), param="lora_path", code="lora_not_found") from None
        except LoraError as exc:
            raise OpenAIError(400, str(exc), param="lora_path", code="invalid_lora") from None
        self._serve(info)
        logger.info("LoRA adapter %s served (parent %s)", name, self.parent)
        return 200, {"object": "lora_adapter", "loaded": True, **info}

    async def unload(self, call: HTTPCall) -> tuple[int, Any]:
        self._require_admin(call)
        (name,) = self._body(call, ("lora_name",))
        if not isinstance(self.serving.engines.get(name), LoraModelView):
            raise OpenAIError(404, f"no LoRA adapter named {name!r} is loaded",
                              param="lora_name", code="lora_not_found")
        try:
            await self.engine.unload_lora_adapter(name)
        except LoraInUse as exc:
            raise OpenAIError(409, str(exc), param="lora_name", code="lora_in_use") from None
        except LoraNotFound as exc:
            raise OpenAIError(404, str(exc), param="lora_name", code="lora_not_found") from None
        self._unserve(name)
        return 200, {"object": "lora_adapter", "name": name, "unloaded": True}


def lora_routes(serving: OpenAIServing, engine: EngineClient, parent: str,
                gateway: Optional[Gateway] = None) -> list[ExtraRoute]:
    """Serve ``engine``'s adapters; the load/unload endpoints (none without LoRA)."""
    if not LoraAdapters.supported(engine):
        return []
    # an engine with the adapter operations (LoraAdmin) is a LoraEngineClient
    adapters = LoraAdapters(serving, cast(LoraEngineClient, engine), parent, gateway)
    return [ExtraRoute("POST", "/v1/load_lora_adapter", adapters.load),
            ExtraRoute("POST", "/v1/unload_lora_adapter", adapters.unload)]
