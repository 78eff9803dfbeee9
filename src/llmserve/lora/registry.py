"""LoRA adapters as the engine core sees them: names, files, content hashes (no torch).

An adapter is a PEFT folder (``adapter_config.json`` + ``adapter_model.safetensors``).
The engine keeps a :class:`LoraRegistry` of the adapters it may run; each request
names at most one (``Request.lora``, a :class:`LoraRef`), and the model runner maps the
ref to a weight slot. Identity is the sha256 of both files, so the same name re-loaded
from changed files is a different adapter: a different prefix-cache namespace
(:func:`lora_cache_salt`) and a different fingerprint.

Only plain LoRA is accepted: ``peft_type`` LORA, targets among the Llama-style
projections, no DoRA, no ``modules_to_save``, no per-layer rank or alpha patterns, no
bias training (see docs/LORA.md "Limits").
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import threading
from dataclasses import dataclass
from typing import Any, Optional

from llmserve.contract.names import NAME_RULE, is_valid_name

#: the largest |lora_alpha / r| accepted (PEFT adapters use single or double digits)
MAX_SCALING = 1024.0

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

#: PEFT module names a LoRA may target (the base model's projections).
SUPPORTED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                     "down_proj")


class LoraError(ValueError):
    """A bad adapter (missing files, unsupported PEFT feature, too large a rank)."""


class LoraNotFound(LoraError):
    """The adapter name or path does not exist."""


class LoraInUse(RuntimeError):
    """An adapter cannot be unloaded: requests still use it."""


@dataclass(frozen=True)
class LoraRef:
    """One registered adapter: plain data the engine core and the runner share."""

    name: str
    path: str
    content_hash: str                  # sha256 hex of adapter_config.json + the weights
    rank: int
    scaling: float                     # lora_alpha / r (or / sqrt(r) with use_rslora)
    target_modules: tuple[str, ...]

    @property
    def short_hash(self) -> str:
        return self.content_hash[:16]


def _falsy(value: Any) -> bool:
    return value in (None, False, [], {}, "", "none")


def parse_peft_config(cfg: dict[str, Any]) -> tuple[int, float, tuple[str, ...]]:
    """``(rank, scaling, target modules)`` of a PEFT LoRA config; LoraError if unsupported."""
    peft_type = str(cfg.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise LoraError(f"peft_type {peft_type!r} is not supported (only LORA)")
    if cfg.get("use_dora"):
        raise LoraError("DoRA adapters (use_dora: true) are not supported")
    for key in ("modules_to_save", "rank_pattern", "alpha_pattern", "layers_to_transform",
                "trainable_token_indices", "lora_bias", "layer_replication", "target_parameters",
                "alora_invocation_tokens", "fan_in_fan_out", "use_qalora"):
        if not _falsy(cfg.get(key)):
            raise LoraError(f"adapters with {key!r} are not supported")
    if cfg.get("bias", "none") != "none":
        raise LoraError(f"adapters that train biases (bias: {cfg.get('bias')!r}) are not "
                        "supported")
    rank = cfg.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise LoraError(f"adapter_config.json: r must be a positive integer, got {rank!r}")
    alpha = cfg.get("lora_alpha", rank)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise LoraError(f"adapter_config.json: lora_alpha must be a finite number, got {alpha!r}")
    targets = cfg.get("target_modules")
    if isinstance(targets, str):
        if targets == "all-linear":
            targets = list(SUPPORTED_TARGETS)
        else:
            raise LoraError(f"target_modules as a regular expression ({targets!r}) is not "
                            f"supported; list modules among {list(SUPPORTED_TARGETS)}")
    if not isinstance(targets, list) or not targets:
        raise LoraError("adapter_config.json: target_modules must be a non-empty list")
    bad = sorted(set(targets) - set(SUPPORTED_TARGETS))
    if bad:
        raise LoraError(f"target modules {bad} are not supported; a LoRA may target "
                        f"{list(SUPPORTED_TARGETS)}")
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    if not abs(scaling) <= MAX_SCALING:
        raise LoraError(f"adapter_config.json: lora_alpha {alpha!r} with r={rank} gives a "
                        f"scaling of {scaling:g}, beyond +-{MAX_SCALING:g} (the adapter's "
                        "delta would swamp the base weights or overflow)")
    return rank, float(scaling), tuple(t for t in SUPPORTED_TARGETS if t in targets)


def read_adapter(name: str, path: str) -> LoraRef:
    """Read and validate the PEFT folder ``path``; hash both files (their identity)."""
    folder = os.path.abspath(os.path.expanduser(path))
    config_path = os.path.join(folder, CONFIG_FILE)
    weights_path = os.path.join(folder, WEIGHTS_FILE)
    if not os.path.isdir(folder):
        raise LoraNotFound(f"LoRA adapter folder {path!r} does not exist")
    for needed in (config_path, weights_path):
        if not os.path.isfile(needed):
            raise LoraNotFound(f"LoRA adapter {path!r} has no {os.path.basename(needed)} "
                               "(a PEFT folder needs adapter_config.json and "
                               "adapter_model.safetensors)")
    try:
        with open(config_path, "rb") as f:
            cfg = json.loads(f.read())
    except ValueError as exc:
        raise LoraError(f"{config_path}: not valid JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise LoraError(f"{config_path}: expected a JSON object")
    rank, scaling, targets = parse_peft_config(cfg)
    return LoraRef(name, folder, adapter_content_hash(folder), rank, scaling, targets)


def adapter_content_hash(folder: str) -> str:
    """sha256 hex over the adapter's config and weight files (its identity)."""
    digest = hashlib.sha256(b"llmserve-lora-v1\x00")
    for i, name in enumerate((CONFIG_FILE, WEIGHTS_FILE)):
        digest.update(b"\x00file%d\x00" % i)
        with open(os.path.join(folder, name), "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


def lora_cache_salt(cache_salt: Optional[str], lora: Optional[LoraRef]) -> Optional[str]:
    """The prefix-cache namespace of a request under ``lora``: a sub-namespace of the
    tenant's (flushing the tenant drops it too) keyed by the adapter's content hash."""
    if lora is None:
        return cache_salt
    tag = f"lora:{lora.content_hash}"
    return tag if cache_salt is None else f"{cache_salt}|{tag}"


def lora_fingerprint(base_fingerprint: str, lora: LoraRef) -> str:
    """The engine fingerprint of requests under ``lora`` (base plus adapter identity)."""
    return hashlib.sha256(f"{base_fingerprint}\x00lora\x00{lora.content_hash}".encode()
                          ).hexdigest()


class LoraRegistry:
    """The adapters an engine may run, by name (thread-safe; bounded by ``max_rank``)."""

    def __init__(self, max_loras: int, max_rank: int) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras must be >= 1 to serve LoRA adapters, got {max_loras}")
        if max_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {max_rank}")
        self.max_loras = max_loras
        self.max_rank = max_rank
        self._by_name: dict[str, LoraRef] = {}
        self._lock = threading.Lock()

    def read(self, name: str, path: str) -> LoraRef:
        """Validate an adapter folder for this registry (does not register it)."""
        if not is_valid_name(name):
            raise LoraError(f"LoRA adapter name {name!r} is not a valid name: {NAME_RULE} "
                            "(it becomes a served model name and a response header)")
        ref = read_adapter(name, path)
        if ref.rank > self.max_rank:
            raise LoraError(f"LoRA adapter {name!r} has rank {ref.rank}, above --max-lora-rank "
                            f"{self.max_rank}")
        return ref

    def add(self, ref: LoraRef) -> None:
        with self._lock:
            if ref.name in self._by_name:
                raise LoraError(f"a LoRA adapter named {ref.name!r} is already loaded")
            self._by_name[ref.name] = ref

    def remove(self, name: str) -> LoraRef:
        with self._lock:
            ref = self._by_name.pop(name, None)
        if ref is None:
            raise LoraNotFound(f"no LoRA adapter named {name!r} is loaded")
        return ref

    def get(self, name: str) -> Optional[LoraRef]:
        return self._by_name.get(name)

    def list(self) -> list[LoraRef]:
        with self._lock:
            return list(self._by_name.values())


class AdapterStepBudget:
    """At most ``max_loras`` distinct adapters in one step (the runner's slot count)."""

    __slots__ = ("max_loras", "chosen")

    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self.chosen: set[str] = set()

    def admits(self, lora: Optional[LoraRef]) -> bool:
        """True (and the adapter counted) when a sequence under ``lora`` fits this step."""
        if lora is None or self.max_loras <= 0:
            return True
        key = lora.content_hash
        if key in self.chosen:
            return True
        if len(self.chosen) >= self.max_loras:
            return False
        self.chosen.add(key)
        return True
