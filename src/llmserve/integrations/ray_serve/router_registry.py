"""The request routers of this process, by (application, deployment) (no Ray).

Ray Serve pickles a custom request router's module by value and rebuilds the class in
every process holding a handle, so state the ingress must share with its router cannot
live in that module: the router registers itself here (an ordinary import on both sides),
and the ingress reads the replicas' stats and the routing decisions through it.
"""
from __future__ import annotations

import threading
from typing import Optional, Protocol

from llmserve.protocol import EngineStats


class StatsSource(Protocol):
    """What a registered router offers the ingress."""

    def stats_by_replica(self) -> dict[str, EngineStats]:
        """Each replica's last routing stats, by replica id."""
        ...

    def decisions_by_replica(self) -> dict[str, dict[str, int]]:
        """Routing decisions counted per replica id and decision."""
        ...


_ROUTERS: dict[tuple[str, str], StatsSource] = {}
_LOCK = threading.Lock()


def register(app_name: str, deployment: str, router: StatsSource) -> None:
    with _LOCK:
        _ROUTERS[(app_name, deployment)] = router


def _router(app_name: str, deployment: str) -> Optional[StatsSource]:
    with _LOCK:
        return _ROUTERS.get((app_name, deployment))


def replica_stats(app_name: str, deployment: str) -> Optional[dict[str, EngineStats]]:
    """The last routing stats of each replica as this process's router sees them (None
    before the handle's router exists)."""
    router = _router(app_name, deployment)
    return None if router is None else router.stats_by_replica()


def router_decisions(app_name: str, deployment: str) -> dict[str, dict[str, int]]:
    """Decisions per replica of this process's router (empty before it exists)."""
    router = _router(app_name, deployment)
    return {} if router is None else router.decisions_by_replica()
