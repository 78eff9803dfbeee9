"""The router's view of its replicas: health, ejection, re-admission, load (no torch).

A daemon thread polls every replica's ``/internal/v1/status`` every ``poll_interval_s``.
A replica is **ejected** after ``eject_after`` failed polls in a row (unreachable, or
not ready), or at once when a request finds it unreachable; it is **re-admitted** after
``readmit_after`` good polls in a row. Only admitted replicas take new requests and sit
on the hash ring (rebuilt when the set changes, so only an ejected replica's keys move).
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Optional

import httpx

from llmserve.protocol import EngineStats
from llmserve.router.policy import HashRing, ReplicaLoad
from llmserve.router.replica_client import ReplicaClient

logger = logging.getLogger(__name__)

#: Counted router decisions (``llmserve_router_decisions_total{decision=...}``).
DECISIONS = ("affinity", "fallback", "round_robin", "least_loaded")


@dataclass
class Replica:
    """One engine replica and what the router knows about it."""

    name: str
    client: ReplicaClient
    admitted: bool = True
    stats: EngineStats = field(default_factory=EngineStats)
    in_flight_remote: int = 0
    outstanding_tokens: int = 0
    requests: int = 0
    fail_streak: int = 0
    ok_streak: int = 0
    ejections: int = 0
    readmissions: int = 0
    retries_from: int = 0
    decisions: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DECISIONS, 0))

    def is_admitted(self) -> bool:
        """Whether the replica takes new requests now (read at each retry decision)."""
        return self.admitted

    def load(self) -> ReplicaLoad:
        total = self.stats.kv_blocks_total
        return ReplicaLoad(self.name, self.outstanding_tokens, self.stats.num_waiting,
                           max(0, total - self.stats.kv_blocks_used), total)


class ReplicaSet:
    """Replicas, their health thread and the hash ring over the admitted ones."""

    def __init__(self, replicas: list[Replica], *, virtual_nodes: int = 64,
                 poll_interval_s: float = 1.0, poll_timeout_s: float = 2.0,
                 eject_after: int = 2, readmit_after: int = 2) -> None:
        if not replicas:
            raise ValueError("a router needs at least one replica")
        if eject_after < 1 or readmit_after < 1:
            raise ValueError("eject_after and readmit_after must be at least 1")
        self.replicas = replicas
        self.by_name = {r.name: r for r in replicas}
        self.lock = threading.Lock()
        self._virtual_nodes = virtual_nodes
        self._poll_interval_s = poll_interval_s
        self._poll_timeout_s = poll_timeout_s
        self._eject_after, self._readmit_after = eject_after, readmit_after
        self.ring = HashRing([r.name for r in replicas], virtual_nodes)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # ---- health ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start the health-check thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._poll_loop, name="llmserve-router-health",
                                            daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self._poll_timeout_s + 1.0)

    def _poll_loop(self) -> None:
        with httpx.Client(timeout=self._poll_timeout_s) as client:
            while not self._stop.is_set():
                self.poll_once(client)
                self._stop.wait(self._poll_interval_s)

    def poll_now(self) -> None:
        """One synchronous round of status polls (start-up)."""
        with httpx.Client(timeout=self._poll_timeout_s) as client:
            self.poll_once(client)

    def poll_once(self, client: httpx.Client) -> None:
        """Poll every replica once and apply the ejection / re-admission rules."""
        for replica in self.replicas:
            try:
                ready, stats, in_flight = replica.client.fetch_status(client)
            except (httpx.HTTPError, OSError, ValueError, KeyError) as exc:
                logger.debug("status of %s failed: %r", replica.name, exc)
                self.record(replica, ok=False, reason=f"status poll failed: {exc!r}")
                continue
            with self.lock:
                replica.stats, replica.in_flight_remote = stats, in_flight
            self.record(replica, ok=ready, reason="not ready")

    def record(self, replica: Replica, ok: bool, reason: str = "",
               eject_now: bool = False) -> None:
        """Count one good or bad observation of ``replica``; eject or re-admit it."""
        changed = False
        with self.lock:
            if ok:
                replica.fail_streak, replica.ok_streak = 0, replica.ok_streak + 1
                if not replica.admitted and replica.ok_streak >= self._readmit_after:
                    replica.admitted, changed = True, True
                    replica.readmissions += 1
                    logger.warning("replica %s re-admitted", replica.name)
            else:
                replica.ok_streak, replica.fail_streak = 0, replica.fail_streak + 1
                if replica.admitted and (eject_now or replica.fail_streak >= self._eject_after):
                    replica.admitted, changed = False, True
                    replica.ejections += 1
                    logger.warning("replica %s ejected: %s", replica.name, reason)
            if changed:
                self.ring = HashRing([r.name for r in self.replicas if r.admitted],
                                     self._virtual_nodes)

    def admitted(self) -> list[Replica]:
        with self.lock:
            return [r for r in self.replicas if r.admitted]

