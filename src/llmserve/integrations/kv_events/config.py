"""``--kv-events-config``: vLLM's ``KVEventsConfig`` JSON, plus llmserve's hashing keys.

vLLM's keys (same names and defaults)::

    enable_kv_cache_events  false   publish at all
    publisher               "null"  "zmq" (or "null": events off)
    endpoint                "tcp://*:5557"   a '*' / '::' / ipc:// / inproc:// endpoint is
                                    bound, anything else connected to (vLLM's rule)
    replay_endpoint         null    ROUTER socket serving missed batches by sequence number
    buffer_steps            10000   batches kept for replay
    hwm                     100000  ZMQ send high-water mark
    max_queue_size          100000  batches waiting for the publisher thread
    topic                   ""      first frame of every message

llmserve's keys: ``block_hash`` ("llmserve" or "vllm": engine/kv/kv_events.py),
``hash_seed`` (vLLM's PYTHONHASHSEED for the "vllm" chain, default "0"), ``medium``
(default "GPU", vLLM's name for the model server's own KV pool).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from typing import Any, Optional

from llmserve.engine.kv.kv_events import ExternalHashing


@dataclass(frozen=True)
class KVEventsConfig:
    """Parsed ``--kv-events-config`` (see the module docstring)."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: Optional[str] = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    block_hash: str = "llmserve"
    hash_seed: str = "0"
    medium: str = "GPU"

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher != "null"

    @property
    def hashing(self) -> ExternalHashing:
        return ExternalHashing(self.block_hash, str(self.hash_seed), self.medium)

    @classmethod
    def parse(cls, text: str) -> "KVEventsConfig":
        """From a JSON object, or the path of a file holding one; ValueError if invalid."""
        source = text
        if not text.lstrip().startswith("{") and os.path.isfile(text):
            with open(text, encoding="utf-8") as f:
                source = f.read()
        try:
            data: Any = json.loads(source)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--kv-events-config is not valid JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ValueError(f"--kv-events-config: unknown key(s) {unknown}; known: {sorted(known)}")
        config = cls(**data)
        config.validate()
        return config

    def validate(self) -> None:
        if self.publisher not in ("null", "zmq"):
            raise ValueError(f"--kv-events-config: publisher must be 'zmq' or 'null', "
                             f"got {self.publisher!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"--kv-events-config: {name} must be a positive integer")
        if not isinstance(self.endpoint, str) or "://" not in self.endpoint:
            raise ValueError(f"--kv-events-config: endpoint must be a ZMQ address such as "
                             f"tcp://*:5557, got {self.endpoint!r}")
        self.hashing   # noqa: B018 - validates block_hash
