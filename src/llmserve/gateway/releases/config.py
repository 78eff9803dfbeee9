"""The ``releases`` section of the gateway config: versioned releases per public model.

A *public model* is a name clients put in ``"model"`` that is not itself a served
model: the gateway maps it to one of its *releases*. A release names a served model
(an engine name, a fallback/extra engine or an adapter name), the artifact identity
it must have (weights, quantization, adapter, tokenizer, chat template -- taken from
the serving engine where the config leaves them out, checked against it where the
config pins them) and sampling defaults applied when a request omits a field::

    releases:
      chat:
        stable: chat-v1
        canary: {release: chat-v2, share: 0.1}
        pins: {acme: chat-v1}                 # tenant -> release id
        shadow: {release: chat-v3, share: 0.05}
        health: {window_s: 60, min_requests: 20, max_error_rate: 0.05,
                 max_ttft_p95_s: 2.0, max_tpot_p95_s: 0.2, min_shadow_agreement: 0.8}
        gates: {max_ttft_p95_ratio: 1.25, max_tpot_p95_ratio: 1.25,
                min_throughput_ratio: 0.8, min_greedy_agreement: 0.9}
        versions:
          chat-v1: {target: small, sampling: {temperature: 0.7, max_tokens: 256}}
          chat-v2: {target: small-q8, quantization: int8}

Validation is strict (unknown keys, wrong types, a canary or pin naming no version, a
share outside [0, 1] raise ``ValueError`` naming the place). Release ids are unique
across the whole config. See docs/RELEASES.md. No torch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from llmserve.gateway.config.fields import (
    Section,
    finite_number,
    identifier,
    integer,
    kind,
    mapping,
    positive_int,
    positive_number,
    string,
)

#: Identity fields a release may pin; the rest comes from its target engine.
IDENTITY_FIELDS = ("weights", "quantization", "adapter", "tokenizer", "chat_template")

#: Sampling defaults a release may set, with their checks.
_FLOAT_DEFAULTS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                   "repetition_penalty")
_INT_DEFAULTS = ("max_tokens", "top_k", "seed")


def share_value(value: Any, path: str) -> float:
    """A traffic share: a number in [0, 1]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{path}: expected a number in [0, 1], got {kind(value)}")
    if not 0 <= value <= 1:
        raise ValueError(f"{path}: must be between 0 and 1, got {value}")
    return float(value)


@dataclass(frozen=True)
class ReleaseSpec:
    """One release as configured: id, served target, pinned identity, sampling defaults."""

    id: str
    target: str
    identity: Mapping[str, str] = field(default_factory=dict)   # only the pinned fields
    sampling: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class HealthThresholds:
    """When a running canary is rolled back automatically (None: not checked)."""

    window_s: float = 60.0
    min_requests: int = 20
    max_error_rate: Optional[float] = None
    max_ttft_p95_s: Optional[float] = None
    max_tpot_p95_s: Optional[float] = None
    min_shadow_agreement: Optional[float] = None
    min_shadow_samples: int = 10


@dataclass(frozen=True)
class GateThresholds:
    """What ``llmserve release check`` requires of a candidate against the stable release."""

    max_ttft_p95_ratio: float = 1.25
    max_tpot_p95_ratio: float = 1.25
    min_throughput_ratio: float = 0.8
    min_greedy_agreement: float = 0.9
    max_error_rate: float = 0.0
    min_structured_validity: Optional[float] = None   # None: the release serves no JSON mode


@dataclass(frozen=True)
class ModelReleases:
    """The releases of one public model name and how traffic is split among them."""

    name: str
    versions: Mapping[str, ReleaseSpec]
    stable: str
    canary: Optional[str] = None
    canary_share: float = 0.0
    pins: Mapping[str, str] = field(default_factory=dict)
    shadow: Optional[str] = None
    shadow_share: float = 0.0
    health: HealthThresholds = HealthThresholds()
    gates: GateThresholds = GateThresholds()


def parse_releases(data: Optional[Mapping], tenants: Mapping[str, Any]) -> dict[str, ModelReleases]:
    """The validated ``releases`` section (``{}`` when absent)."""
    if data is None:
        return {}
    out: dict[str, ModelReleases] = {}
    owner: dict[str, str] = {}
    for name, body in mapping(data, "releases").items():
        path = f"releases.{name}"
        identifier(name, path)
        model = _parse_model(name, Section(body, path), tenants)
        for rid in model.versions:
            if rid in owner:
                raise ValueError(f"{path}.versions.{rid}: release id already used by "
                                 f"releases.{owner[rid]}")
            owner[rid] = name
        out[name] = model
    return out


def _version_ref(value: Any, path: str, versions: Mapping[str, ReleaseSpec]) -> str:
    rid = string(value, path)
    if rid not in versions:
        raise ValueError(f"{path}: {rid!r} is not one of this model's versions "
                         f"{sorted(versions)}")
    return rid


def _parse_model(name: str, section: Section, tenants: Mapping[str, Any]) -> ModelReleases:
    path = section.path
    raw_versions = section.take("versions", mapping, None)
    if not raw_versions:
        raise ValueError(f"{path}.versions: required (at least one release)")
    versions = {rid: _parse_version(rid, body, f"{path}.versions.{rid}")
                for rid, body in raw_versions.items()}
    stable = section.take("stable", lambda v, p: _version_ref(v, p, versions), None)
    if stable is None:
        raise ValueError(f"{path}.stable: required (the release id that takes the traffic)")
    canary, canary_share = _parse_split(section.take("canary", mapping, None),
                                        section.child("canary"), versions, stable)
    shadow, shadow_share = _parse_split(section.take("shadow", mapping, None),
                                        section.child("shadow"), versions, stable)
    pins: dict[str, str] = {}
    for tenant, rid in section.take("pins", mapping, {}).items():
        where = f"{path}.pins.{tenant}"
        if tenant not in tenants:
            raise ValueError(f"{where}: no tenant {tenant!r} in `tenants`")
        pins[tenant] = _version_ref(rid, where, versions)
    health = _parse_health(section.take("health", mapping, {}), section.child("health"))
    gates = _parse_gates(section.take("gates", mapping, {}), section.child("gates"))
    section.finish()
    return ModelReleases(name=name, versions=versions, stable=stable, canary=canary,
                         canary_share=canary_share, pins=pins, shadow=shadow,
                         shadow_share=shadow_share, health=health, gates=gates)


def _parse_split(data: Optional[Mapping], path: str, versions: Mapping[str, ReleaseSpec],
                 stable: str) -> tuple[Optional[str], float]:
    if data is None:
        return None, 0.0
    section = Section(data, path)
    rid = section.take("release", lambda v, p: _version_ref(v, p, versions), None)
    if rid is None:
        raise ValueError(f"{path}.release: required")
    if rid == stable:
        raise ValueError(f"{path}.release: {rid!r} is the stable release")
    share = section.take("share", share_value, None)
    if share is None:
        raise ValueError(f"{path}.share: required (a number in [0, 1])")
    section.finish()
    return rid, share


def _parse_version(rid: str, body: Any, path: str) -> ReleaseSpec:
    identifier(rid, path)
    section = Section(body, path)
    target = section.take("target", string, None)
    if target is None:
        raise ValueError(f"{path}.target: required (the served model name this release uses)")
    identity = {}
    for key in IDENTITY_FIELDS:
        value = section.take(key, string, None)
        if value is not None:
            identity[key] = value
    sampling = _parse_sampling(section.take("sampling", mapping, {}), section.child("sampling"))
    section.finish()
    return ReleaseSpec(id=rid, target=target, identity=identity, sampling=sampling)


def _parse_sampling(data: Mapping, path: str) -> dict[str, Any]:
    section = Section(data, path)
    out: dict[str, Any] = {}
    for key in _FLOAT_DEFAULTS:
        value = section.take(key, finite_number, None)
        if value is not None:
            out[key] = value
    for key in _INT_DEFAULTS:
        value = section.take(key, positive_int if key != "seed" else integer, None)
        if value is not None:
            out[key] = value
    section.finish()
    if "temperature" in out and out["temperature"] < 0:
        raise ValueError(f"{path}.temperature: must be >= 0, got {out['temperature']}")
    if "top_p" in out and not 0 < out["top_p"] <= 1:
        raise ValueError(f"{path}.top_p: must be in (0, 1], got {out['top_p']}")
    return out


def _parse_health(data: Mapping, path: str) -> HealthThresholds:
    section = Section(data, path)
    default = HealthThresholds()
    health = HealthThresholds(
        window_s=section.take("window_s", positive_number, default.window_s),
        min_requests=section.take("min_requests", positive_int, default.min_requests),
        max_error_rate=section.take("max_error_rate", share_value, None),
        max_ttft_p95_s=section.take("max_ttft_p95_s", positive_number, None),
        max_tpot_p95_s=section.take("max_tpot_p95_s", positive_number, None),
        min_shadow_agreement=section.take("min_shadow_agreement", share_value, None),
        min_shadow_samples=section.take("min_shadow_samples", positive_int,
                                        default.min_shadow_samples))
    section.finish()
    return health


def _parse_gates(data: Mapping, path: str) -> GateThresholds:
    section = Section(data, path)
    default = GateThresholds()
    gates = GateThresholds(
        max_ttft_p95_ratio=section.take("max_ttft_p95_ratio", positive_number,
                                        default.max_ttft_p95_ratio),
        max_tpot_p95_ratio=section.take("max_tpot_p95_ratio", positive_number,
                                        default.max_tpot_p95_ratio),
        min_throughput_ratio=section.take("min_throughput_ratio", positive_number,
                                          default.min_throughput_ratio),
        min_greedy_agreement=section.take("min_greedy_agreement", share_value,
                                          default.min_greedy_agreement),
        max_error_rate=section.take("max_error_rate", share_value, default.max_error_rate),
        min_structured_validity=section.take("min_structured_validity", share_value, None))
    section.finish()
    return gates
