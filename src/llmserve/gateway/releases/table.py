"""Releases at run time: each release's full identity and fingerprint, and the live
traffic split of every public model (stable, canary share, shadow share, pins).

:func:`resolve_release` completes a configured release with its target engine's
identity (weights, quantization, adapter, tokenizer and chat template fingerprints),
checks the fields the config pins, and hashes everything -- identity, engine
fingerprint and sampling defaults -- into the release fingerprint.

:class:`ReleaseTable` picks the release of each request: a tenant pin wins; otherwise
a weighted round robin sends exactly ``share`` of the requests to the canary (an
accumulator, so a 50/50 split of 200 requests is 100/100 and a 10 % canary gets every
tenth request). Changes (share, promote, rollback) only affect requests that have
not picked a release yet: a request keeps the release it started on until it ends
(``enter``/``leave`` count them, so an operator can watch an old release drain).

A release whose target is not served yet (a LoRA adapter loaded at run time) is
resolved the first time a request picks it; until then picking it raises
:class:`ReleaseUnavailable` (the gateway answers 503 and counts it against the release).
Thread-safe. No torch.
"""
from __future__ import annotations

import hashlib
import json
import logging
import random
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

from llmserve.contract.engine_client import EngineClient
from llmserve.gateway.releases.config import IDENTITY_FIELDS, ModelReleases, ReleaseSpec

logger = logging.getLogger(__name__)


class ReleaseUnavailable(Exception):
    """The picked release's target is not served (yet)."""

    def __init__(self, release: str, target: str) -> None:
        super().__init__(f"release {release!r}: its served model {target!r} is not served")
        self.release = release
        self.target = target


@dataclass(frozen=True)
class Release:
    """One release with its resolved identity (see the module docstring)."""

    id: str
    model: str                           # the public model name
    target: str                          # the served model name that runs it
    identity: Mapping[str, Optional[str]]
    engine_fingerprint: str
    sampling: Mapping[str, Any]
    fingerprint: str

    def describe(self) -> dict[str, Any]:
        """The release as the admin API shows it."""
        return {"id": self.id, "model": self.model, "target": self.target,
                "fingerprint": self.fingerprint, "engine_fingerprint": self.engine_fingerprint,
                "identity": dict(self.identity), "sampling": dict(self.sampling)}


def _digest(text: Optional[str]) -> Optional[str]:
    return hashlib.sha256(text.encode("utf-8")).hexdigest() if text else None


def engine_identity(engine: EngineClient) -> dict[str, Optional[str]]:
    """What an engine reports of its artifacts (None where it does not say).

    Reads the loaded model's weights fingerprint and quantization, the adapter's
    content hash (``lora_info["content_hash"]`` of a served LoRA adapter's view), the
    tokenizer's fingerprint and chat template; an engine's
    ``fingerprint_parts()``, when it offers one, overrides them.
    """
    inner = getattr(engine, "engine", engine)
    tokenizer = getattr(engine, "tokenizer", None)
    runner = getattr(inner, "runner", None)
    parts: dict[str, Optional[str]] = {
        "weights": getattr(inner, "weights_fingerprint", None),
        "quantization": getattr(runner, "quantization", None),
        "adapter": (getattr(engine, "lora_info", None) or {}).get("content_hash"),
        "tokenizer": getattr(tokenizer, "fingerprint", None),
        "chat_template": _digest(getattr(tokenizer, "chat_template", None)),
    }
    reported = getattr(engine, "fingerprint_parts", None)
    if callable(reported):
        parts.update({k: v for k, v in dict(reported()).items() if k in IDENTITY_FIELDS})
    return {k: (str(v) if v is not None else None) for k, v in parts.items()}


def _matches(pinned: str, actual: str) -> bool:
    """A pinned value matches the engine's when equal or a prefix of 12+ characters."""
    return pinned == actual or (len(pinned) >= 12 and actual.startswith(pinned))


def resolve_release(spec: ReleaseSpec, model: str, engine: EngineClient) -> Release:
    """The release ``spec`` of public model ``model`` served by ``engine``.

    Raises ValueError when a pinned identity field differs from what the engine reports.
    """
    reported = engine_identity(engine)
    identity = dict(reported)
    for key, pinned in spec.identity.items():
        actual = reported.get(key)
        if actual is not None and not _matches(pinned, actual):
            raise ValueError(f"releases.{model}.versions.{spec.id}.{key}: the config pins "
                             f"{pinned!r} but served model {spec.target!r} has {actual!r}")
        identity[key] = actual or pinned
    engine_fp = str(getattr(engine, "fingerprint", "") or "")
    blob = json.dumps({"identity": identity, "engine": engine_fp,
                       "sampling": dict(spec.sampling)}, sort_keys=True)
    return Release(id=spec.id, model=model, target=spec.target, identity=identity,
                   engine_fingerprint=engine_fp, sampling=dict(spec.sampling),
                   fingerprint=hashlib.sha256(blob.encode("utf-8")).hexdigest())


@dataclass
class ModelState:
    """The live split of one public model."""

    config: ModelReleases
    releases: dict[str, Release]         # the resolved ones (target served)
    stable: str
    canary: Optional[str]
    canary_share: float
    shadow: Optional[str]
    shadow_share: float
    pins: dict[str, str] = field(default_factory=dict)
    credit: float = 0.0                  # the canary's weighted round-robin accumulator

    def snapshot(self) -> dict[str, Any]:
        """The split as the admin API and the state store show it."""
        return {"stable": self.stable, "canary": self.canary, "canary_share": self.canary_share,
                "shadow": self.shadow, "shadow_share": self.shadow_share,
                "pins": dict(self.pins)}


class ReleaseTable:
    """Every public model's releases and live split (see the module docstring).

    Args:
        config: the config's ``releases`` section.
        engines: served model name -> engine, or a function returning the engine of a
            served name (None when it is not served), read again for unresolved targets.
    """

    def __init__(self, config: Mapping[str, ModelReleases],
                 engines: "Mapping[str, Any] | Callable[[str], Any]",
                 rng: Optional[random.Random] = None) -> None:
        self._lock = threading.Lock()
        self._rng = rng or random.Random()
        self._lookup: Callable[[str], Any] = engines if callable(engines) else engines.get
        self.models: dict[str, ModelState] = {}
        self.inflight: Counter[str] = Counter()
        for name, model in config.items():
            if self._lookup(name) is not None:
                raise ValueError(f"releases.{name}: the public model name is also a served "
                                 "model name; pick another public name")
            releases = {}
            for rid, spec in model.versions.items():
                engine = self._lookup(spec.target)
                if engine is None:
                    logger.warning("releases.%s.versions.%s.target: %r is not served (yet); "
                                   "requests that pick this release get 503 until it is",
                                   name, rid, spec.target)
                    continue
                releases[rid] = resolve_release(spec, name, engine)
            self.models[name] = ModelState(model, releases, model.stable, model.canary,
                                           model.canary_share, model.shadow, model.shadow_share,
                                           dict(model.pins))

    def public_models(self) -> dict[str, str]:
        """Public model name -> the target of its stable release."""
        with self._lock:
            return {n: s.config.versions[s.stable].target for n, s in self.models.items()}

    def _resolved(self, state: ModelState, rid: str) -> Release:
        """The release ``rid``, resolved now if its target has become served."""
        release = state.releases.get(rid)
        if release is None:
            spec = state.config.versions[rid]
            engine = self._lookup(spec.target)
            if engine is None:
                raise ReleaseUnavailable(rid, spec.target)
            release = state.releases[rid] = resolve_release(spec, state.config.name, engine)
        return release

    def choose(self, model: str, tenant: str) -> tuple[Release, Optional[Release]]:
        """(the release that serves this request, the shadow release mirroring it or None);
        raises :class:`ReleaseUnavailable` when the picked release's target is not served
        (an unserved shadow is skipped)."""
        with self._lock:
            state = self.models[model]
            rid = state.pins.get(tenant)
            if rid is None:
                rid = state.stable
                if state.canary is not None and state.canary_share > 0:
                    state.credit += state.canary_share
                    if state.credit >= 1.0 - 1e-9:
                        state.credit -= 1.0
                        rid = state.canary
            release = self._resolved(state, rid)
            shadow = None
            if (state.shadow is not None and state.shadow != rid and state.shadow_share > 0
                    and self._rng.random() < state.shadow_share):
                try:
                    shadow = self._resolved(state, state.shadow)
                except ReleaseUnavailable:
                    shadow = None
            return release, shadow

    def enter(self, release: Release) -> None:
        """A request on ``release`` was admitted: it is in flight until ``leave``."""
        with self._lock:
            self.inflight[release.id] += 1

    def leave(self, release: Release) -> None:
        """A request counted by ``enter`` ended."""
        with self._lock:
            self.inflight[release.id] -= 1
            if self.inflight[release.id] <= 0:
                del self.inflight[release.id]

    def update(self, model: str, **changes: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        """Apply split changes (``stable``, ``canary``, ``canary_share``, ``shadow``,
        ``shadow_share``); returns (before, after) snapshots. Raises KeyError for an
        unknown model and ValueError for a change that names no version of it."""
        with self._lock:
            state = self.models[model]
            before = state.snapshot()
            for key in ("stable", "canary", "shadow"):
                rid = changes.get(key, getattr(state, key))
                if rid is not None and rid not in state.config.versions:
                    raise ValueError(f"{rid!r} is not a release of {model!r} "
                                     f"(releases: {sorted(state.config.versions)})")
            for key, value in changes.items():
                setattr(state, key, value)
            if state.canary == state.stable:
                state.canary = None
            if state.canary is None:
                state.canary_share = 0.0
            state.credit = 0.0
            return before, state.snapshot()

    def snapshot(self, model: str) -> dict[str, Any]:
        """One model's split, releases and requests in flight per release."""
        with self._lock:
            state = self.models[model]
            out = state.snapshot()
            out["releases"] = {}
            for rid, spec in state.config.versions.items():
                found = state.releases.get(rid)
                info: dict[str, Any] = found.describe() if found is not None else {
                    "id": rid, "model": model, "target": spec.target, "fingerprint": None}
                info["served"] = found is not None
                info["in_flight"] = self.inflight.get(rid, 0)
                out["releases"][rid] = info
            return out
