"""An engine's LoRA adapters: the torch-free registry plus the runner's slots, kept in step.

``LLMEngine.loras`` is an :class:`EngineLoras`. Requests name an adapter (``lora=``) and
carry its :class:`~llmserve.lora.registry.LoraRef`; the runner's
:class:`~llmserve.lora.manager.LoraManager` holds the tensors. ``add`` and ``remove``
change both and must run on the engine thread (``AsyncLLM.load_lora_adapter`` does).

Removing an adapter that a queued or running request still uses raises
:class:`~llmserve.lora.registry.LoraInUse` (the server answers 409): the caller
retries once those requests finished, so no request ever loses its adapter mid-way.
"""
from __future__ import annotations

import logging
from typing import Any, Mapping, Optional, Protocol

from llmserve.config import EngineConfig
from llmserve.lora.registry import LoraError, LoraInUse, LoraNotFound, LoraRef, LoraRegistry, lora_fingerprint

logger = logging.getLogger(__name__)


class AdapterSlots(Protocol):
    """The runner's side of the adapters (``LoraManager``): their tensors."""

    def register(self, ref: LoraRef) -> None: ...

    def unregister(self, ref: LoraRef) -> None: ...


class RequestTable(Protocol):
    """Where the engine's live requests are (the scheduler)."""

    requests: Mapping[str, Any]


class EngineLoras:
    """Loaded adapters of one engine (empty and disabled when ``max_loras`` is 0)."""

    def __init__(self, config: EngineConfig, slots: Optional[AdapterSlots],
                 scheduler: RequestTable, model_name: str, fingerprint: str) -> None:
        """``slots``: the runner's LoRA manager (None without ``max_loras``); ``scheduler``:
        where the engine's requests are (an adapter in use is never unloaded)."""
        self.slots = slots
        self.scheduler = scheduler
        self.model_name = model_name
        self.base_fingerprint = fingerprint
        self.registry: Optional[LoraRegistry] = None
        if config.lora.max_loras > 0:
            self.registry = LoraRegistry(config.lora.max_loras, config.lora.max_lora_rank)
        for name, path in config.lora.lora_modules:
            self.add(name, path)

    @property
    def enabled(self) -> bool:
        return self.registry is not None

    def _slots(self) -> AdapterSlots:
        if self.slots is None:   # the registry exists only with slots (max_loras > 0)
            raise LoraError("LoRA adapters are not enabled on this engine")
        return self.slots

    def _registry(self) -> LoraRegistry:
        if self.registry is None:
            raise LoraError("LoRA adapters are not enabled on this engine (start it with "
                            "--max-loras N or --lora-modules)")
        return self.registry

    def resolve(self, name: Optional[str]) -> Optional[LoraRef]:
        """The ref of a loaded adapter (None for None); LoraNotFound for another name."""
        if name is None:
            return None
        ref = self._registry().get(name)
        if ref is None:
            raise LoraNotFound(f"no LoRA adapter named {name!r} is loaded")
        return ref

    def add(self, name: str, path: str) -> LoraRef:
        """Validate ``path`` (a PEFT folder), load its tensors into host memory, register it."""
        registry = self._registry()
        if name == self.model_name:
            raise LoraError(f"a LoRA adapter cannot take the base model's name {name!r}")
        if registry.get(name) is not None:
            raise LoraError(f"a LoRA adapter named {name!r} is already loaded")
        ref = registry.read(name, path)
        self._slots().register(ref)
        registry.add(ref)
        logger.info("LoRA adapter %s loaded from %s (rank %d, %s, hash %s)", name, ref.path,
                    ref.rank, ",".join(ref.target_modules), ref.short_hash)
        return ref

    def remove(self, name: str) -> LoraRef:
        """Unregister an adapter; LoraInUse while a request still runs under it."""
        registry = self._registry()
        ref = registry.get(name)
        if ref is None:
            raise LoraNotFound(f"no LoRA adapter named {name!r} is loaded")
        users = sum(1 for r in self.scheduler.requests.values()
                    if r.lora is not None and r.lora.name == name)
        if users:
            raise LoraInUse(f"LoRA adapter {name!r} is used by {users} request(s); unload it "
                            "once they finished")
        registry.remove(name)
        if not any(r.content_hash == ref.content_hash for r in registry.list()):
            self._slots().unregister(ref)   # same files under another name: keep
        logger.info("LoRA adapter %s unloaded", name)
        return ref

    def list(self) -> list[LoraRef]:
        return self.registry.list() if self.registry is not None else []

    def fingerprint(self, ref: LoraRef) -> str:
        """The engine fingerprint of requests under ``ref``."""
        return lora_fingerprint(self.base_fingerprint, ref)

    def describe(self, ref: LoraRef) -> dict[str, Any]:
        """JSON-ready facts about one adapter (for the load endpoint and /v1/models)."""
        fingerprint = self.fingerprint(ref)
        return {"name": ref.name, "path": ref.path, "rank": ref.rank,
                "target_modules": list(ref.target_modules), "content_hash": ref.content_hash,
                "fingerprint": fingerprint, "system_fingerprint": "fp_" + fingerprint[:16]}
