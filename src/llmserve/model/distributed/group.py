"""The tensor-parallel process group: collectives, step broadcast, worker supervision.

Rank 0 is the engine process (scheduler, HTTP, sampling); ranks 1..N-1 are workers that
only run forward passes. Every rank joins one ``torch.distributed`` group through the
``env://`` rendezvous (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``), so the
same code runs when ``torch.multiprocessing`` spawns the workers on one host and when
``torchrun`` starts every rank across hosts. Tensors travel over gloo on CPU and NCCL on
CUDA; control messages (the pickled, sampling-free ``StepInput`` of each step) always
travel over a separate gloo group.

Rank 0 watches the workers it spawned: when one exits, :attr:`failure` is set, the next
``execute`` raises :class:`WorkerDiedError` at once, and the engine reports itself
unready. A worker exits when rank 0 sends the stop message, when a collective fails, or
when its parent process disappears.
"""
from __future__ import annotations

import datetime
import logging
import os
import threading
from typing import Any, Optional

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

#: Seconds a collective may wait for a peer before failing (gloo); a dead peer's closed
#: socket usually fails it much sooner.
COLLECTIVE_TIMEOUT_S = float(os.environ.get("LLMSERVE_TP_TIMEOUT_S", "60"))


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker is gone; this engine cannot run any more steps."""


class TensorParallelGroup:
    """One rank's membership in the tensor-parallel group."""

    def __init__(self, rank: int, world_size: int, device: torch.device) -> None:
        if world_size < 2:
            raise ValueError("a tensor-parallel group needs at least 2 ranks")
        self.rank, self.world_size, self.device = rank, world_size, device
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        dist.init_process_group(self.backend, init_method="env://", rank=rank,
                                world_size=world_size, timeout=timeout)
        self.control = (dist.new_group(backend="gloo", timeout=timeout)
                        if self.backend != "gloo" else dist.group.WORLD)
        self.failure: Optional[str] = None
        self._closed = False
        self.workers: list[Any] = []    # processes this rank spawned (rank 0 on one host)

    # ---- collectives ----------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over ranks, in place; returns it."""
        self._check()
        dist.all_reduce(x)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``x`` along the last dimension (rank order)."""
        self._check()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)

    def agree_min(self, value: int) -> int:
        """The smallest ``value`` over ranks (e.g. KV blocks: every rank's pool must match)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def broadcast_control(self, message: Any) -> Any:
        """Rank 0 sends ``message``; every other rank returns what rank 0 sent."""
        self._check()
        box = [message if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def _check(self) -> None:
        if self.failure is not None:
            raise WorkerDiedError(self.failure)

    @property
    def healthy(self) -> bool:
        return self.failure is None and not self._closed

    # ---- supervision ----------------------------------------------------------------------
    def watch_workers(self, processes: list[Any]) -> None:
        """Rank 0: remember spawned workers and flag the group when one exits."""
        self.workers = list(processes)

        def watch() -> None:
            from multiprocessing.connection import wait

            sentinels = {p.sentinel: p for p in self.workers}
            ready = wait(list(sentinels))
            if self._closed:
                return
            dead = sentinels[ready[0]]
            self.failure = (f"tensor-parallel worker pid {dead.pid} exited with code "
                            f"{dead.exitcode}")
            logger.error("%s; the engine can run no more steps", self.failure)

        threading.Thread(target=watch, name="llmserve-tp-watch", daemon=True).start()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Rank 0: tell the workers to stop, reap them (kill stragglers); leave the group."""
        if self._closed:
            return
        self._closed = True
        if self.rank == 0 and self.failure is None:
            try:
                box: list[Any] = [None]
                dist.broadcast_object_list(box, src=0, group=self.control)
            except Exception as exc:  # noqa: BLE001 - workers may already be gone
                logger.debug("stop message not delivered: %r", exc)
        for proc in self.workers:
            proc.join(timeout_s)
            if proc.is_alive():
                logger.warning("tensor-parallel worker pid %d did not stop; killing it", proc.pid)
                proc.kill()
                proc.join(5)
        try:
            dist.destroy_process_group()
        except Exception as exc:  # noqa: BLE001 - a broken group cannot be torn down cleanly
            logger.debug("destroy_process_group: %r", exc)
