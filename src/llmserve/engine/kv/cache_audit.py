"""Audits of the prefix cache (no torch): a sampled log of hits, and the namespace check.

* :class:`HitAudit` writes one JSON line to the ``llmserve.cache_audit`` logger for a
  sample of prefix-cache hits: the request id, the namespace it asked for, the
  namespaces of the blocks it hit, and how many blocks -- never token ids or text --,
  so a wrong hit can be traced to a request and a namespace. A hit on a block of
  another namespace is always logged, at WARNING, and counted.
* :func:`check_chain_namespaces` verifies that every cached block carries the
  namespace of its chain: the block its hash was chained from (while still cached) has
  the same namespace, and a chain's first block hangs off that namespace's own root.
"""
from __future__ import annotations

import json
import logging
import random
from typing import Callable, Iterable, Mapping, Optional

from llmserve.engine.kv.block_pool import BlockPool, KVBlock

audit_logger = logging.getLogger("llmserve.cache_audit")


class HitAudit:
    """Sampled log of prefix-cache hits (see the module docstring).

    Args:
        sample_rate: share of hits logged, in [0, 1] (0: only wrong-namespace hits).
        rng: a ``random()`` function (tests pass a seeded one).
    """

    def __init__(self, sample_rate: float = 0.0,
                 rng: Optional[Callable[[], float]] = None) -> None:
        self.sample_rate = 0.0
        self.set_sample_rate(sample_rate)
        self._random = rng or random.random
        self.hits = 0
        self.logged = 0
        self.cross_namespace_hits = 0

    def set_sample_rate(self, rate: float) -> None:
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate <= 1:
            raise ValueError(f"the cache audit sample rate must be in [0, 1], got {rate!r}")
        self.sample_rate = float(rate)

    def record(self, request_id: str, namespace: Optional[str], blocks: Iterable[KVBlock]) -> None:
        """One request's prefix hit (its blocks as found, before it takes them)."""
        blocks = list(blocks)
        if not blocks:
            return
        self.hits += 1
        found = sorted({str(b.namespace) for b in blocks})
        wrong = any(b.namespace != namespace for b in blocks)
        if wrong:
            self.cross_namespace_hits += 1
        elif not (self.sample_rate and self._random() < self.sample_rate):
            return
        self.logged += 1
        line = json.dumps({"event": "prefix_cache_hit", "request_id": request_id,
                           "namespace": namespace, "block_namespaces": found,
                           "blocks": len(blocks), "wrong_namespace": wrong},
                          separators=(",", ":"))
        audit_logger.log(logging.WARNING if wrong else logging.INFO, line)


def check_chain_namespaces(pool: BlockPool, roots: Mapping[bytes, Optional[str]]) -> Optional[str]:
    """A description of the first cached block whose namespace differs from its chain's,
    or None when all agree. ``roots`` maps each namespace root hash to its namespace."""
    for block in pool.cached.values():
        parent = block.parent_hash
        if parent is None:
            continue  # registered without chain information
        if parent in roots:
            if roots[parent] != block.namespace:
                return (f"{block}: namespace {block.namespace!r} but its chain starts at the "
                        f"root of {roots[parent]!r}")
            continue
        up = pool.cached.get(parent)
        if up is not None and up.namespace != block.namespace:
            return (f"{block}: namespace {block.namespace!r} but the block it is chained "
                    f"from ({up}) has {up.namespace!r}")
    return None
