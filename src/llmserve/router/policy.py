"""Where a request goes: prefix affinity on a consistent-hash ring, else the least loaded.

Pure functions and small classes, no I/O, so the rules are testable on their own:

* The **affinity key** of a prompt is the prefix cache's own chained hash
  (``engine/kv/block_hash.py``) of its first ``affinity_blocks`` full blocks, rooted in the
  engine fingerprint and the tenant's cache salt. Two prompts share a key exactly when
  they share those tokens in the same namespace, i.e. when the engine could reuse the
  cached blocks. A prompt shorter than one block hashes its whole token list instead.
* The **ring** puts ``virtual_nodes`` points per replica on a 64-bit circle; a key goes
  to the first point clockwise. Ejecting a replica moves only its own keys.
* **Load** (:class:`ReplicaLoad`) is what the router knows per replica: outstanding tokens
  of the requests it sent there (exact, updated as tokens stream back), and the last
  polled queue depth and free KV blocks. The preferred replica is **overloaded** when its
  outstanding tokens exceed both ``balance_abs_tokens`` more and ``balance_rel`` times the
  least loaded one's, or its queue holds more than ``max_waiting`` requests, or its free
  KV fraction is below ``min_free_kv``; then the request goes to the least loaded replica.
"""
from __future__ import annotations

import bisect
import hashlib
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

from llmserve.engine.kv.block_hash import hash_block_tokens, namespace_hash

ROUTING_POLICIES = ("prefix", "round-robin", "least-loaded")


@dataclass(frozen=True)
class RoutingConfig:
    """Knobs of :func:`choose_replica` (defaults suit a few replicas of one small model)."""

    policy: str = "prefix"
    affinity_blocks: int = 4
    virtual_nodes: int = 64
    balance_abs_tokens: int = 4096
    balance_rel: float = 1.5
    max_waiting: int = 16
    min_free_kv: float = 0.05

    def __post_init__(self) -> None:
        if self.policy not in ROUTING_POLICIES:
            raise ValueError(f"routing policy must be one of {ROUTING_POLICIES}, "
                             f"got {self.policy!r}")
        if self.affinity_blocks < 1 or self.virtual_nodes < 1:
            raise ValueError("affinity_blocks and virtual_nodes must be at least 1")
        if self.balance_abs_tokens < 0 or self.balance_rel < 1.0 or self.max_waiting < 0:
            raise ValueError("balance_abs_tokens >= 0, balance_rel >= 1 and max_waiting >= 0 "
                             "are required")
        if not 0.0 <= self.min_free_kv < 1.0:
            raise ValueError(f"min_free_kv must be in [0, 1), got {self.min_free_kv}")


@dataclass
class ReplicaLoad:
    """A replica's load as the router sees it."""

    name: str
    outstanding_tokens: int = 0
    num_waiting: int = 0
    kv_blocks_free: int = 0
    kv_blocks_total: int = 0

    @property
    def free_kv_fraction(self) -> float:
        return self.kv_blocks_free / self.kv_blocks_total if self.kv_blocks_total else 1.0


def _point(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def affinity_key(prompt: Sequence[int], fingerprint: str, cache_salt: Optional[str],
                 block_size: int, affinity_blocks: int) -> int:
    """The 64-bit ring position of a prompt's prefix (see the module docstring)."""
    parent = namespace_hash(fingerprint, cache_salt)
    full = min(len(prompt) // block_size, affinity_blocks)
    if full == 0:
        parent = hash_block_tokens(parent, list(prompt))
    for i in range(full):
        parent = hash_block_tokens(parent, prompt[i * block_size:(i + 1) * block_size])
    return int.from_bytes(parent[:8], "big")


class HashRing:
    """A consistent-hash ring over replica names."""

    def __init__(self, names: Iterable[str], virtual_nodes: int = 64) -> None:
        points = sorted((_point(f"{name}#{v}".encode()), name)
                        for name in names for v in range(virtual_nodes))
        self._keys = [p for p, _ in points]
        self._names = [n for _, n in points]

    def lookup(self, key: int) -> Optional[str]:
        """The replica owning ``key`` (None on an empty ring)."""
        if not self._keys:
            return None
        i = bisect.bisect_right(self._keys, key) % len(self._keys)
        return self._names[i]


def least_loaded(loads: Sequence[ReplicaLoad]) -> ReplicaLoad:
    """Fewest outstanding tokens, then shortest queue, then most free KV."""
    return min(loads, key=lambda r: (r.outstanding_tokens, r.num_waiting, -r.free_kv_fraction))


def is_overloaded(preferred: ReplicaLoad, lightest: ReplicaLoad, config: RoutingConfig) -> bool:
    """Whether ``preferred`` is past the thresholds (module docstring) vs ``lightest``,
    the least loaded of the other candidates."""
    if preferred.num_waiting > config.max_waiting and lightest.num_waiting < preferred.num_waiting:
        return True
    if preferred.free_kv_fraction < config.min_free_kv <= lightest.free_kv_fraction:
        return True
    gap = preferred.outstanding_tokens - lightest.outstanding_tokens
    return (gap > config.balance_abs_tokens
            and preferred.outstanding_tokens > config.balance_rel * lightest.outstanding_tokens)


def choose_replica(loads: Sequence[ReplicaLoad], ring: HashRing, key: Optional[int],
                   config: RoutingConfig, round_robin_index: int) -> tuple[str, str]:
    """(replica name, decision) among ``loads`` (the healthy candidates, non-empty).

    Decisions: ``affinity`` (the ring's replica), ``fallback`` (the ring's replica was
    overloaded, or is not a candidate: the least loaded), ``round_robin``, ``least_loaded``.
    """
    if not loads:
        raise ValueError("no replica to choose from")
    if config.policy == "round-robin":
        return loads[round_robin_index % len(loads)].name, "round_robin"
    lightest = least_loaded(loads)
    if config.policy == "least-loaded" or key is None:
        return lightest.name, "least_loaded"
    owner = ring.lookup(key)
    preferred = next((r for r in loads if r.name == owner), None)
    if preferred is None:
        return lightest.name, "fallback"
    others = [r for r in loads if r is not preferred]
    if others:
        alternative = least_loaded(others)
        if is_overloaded(preferred, alternative, config):
            return alternative.name, "fallback"
    return preferred.name, "affinity"
