"""A thread pool that shares its threads fairly among tenants.

Parsing a big body and tokenizing a long prompt are blocking CPU work; the server runs
them on a few worker threads. With a plain FIFO pool one tenant sending many large
prompts fills every thread and every queue slot, and another tenant's one-token request
waits behind all of them. :class:`FairThreadPool` instead keeps one FIFO per key (the
tenant) and

* serves the keys round-robin: a free thread takes the oldest job of the next key in
  turn that has one waiting;
* runs at most ``per_key_limit`` jobs of one key at once (default: all threads but
  one, at least one), so with two or more threads one tenant can never hold them all.

A job that is cancelled before a thread picks it up never runs. No torch here.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures as cf
import logging
import threading
from typing import Any, Callable, Optional, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")


class _Job:
    __slots__ = ("future", "fn", "args")

    def __init__(self, future: "cf.Future[Any]", fn: Callable[..., Any], args: tuple) -> None:
        self.future = future
        self.fn = fn
        self.args = args


class FairThreadPool:
    """``workers`` daemon threads, round-robin over keys (see the module docstring).

    Args:
        workers: number of threads (started lazily, on the first job).
        per_key_limit: most jobs of one key running at once; default
            ``max(1, workers - 1)``.
        name: thread name prefix.
    """

    def __init__(self, workers: int = 2, per_key_limit: Optional[int] = None,
                 name: str = "llmserve-tokenize") -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        limit = max(1, workers - 1) if per_key_limit is None else per_key_limit
        if limit < 1:
            raise ValueError(f"per_key_limit must be >= 1, got {per_key_limit}")
        self.workers = workers
        self.per_key_limit = limit
        self._name = name
        self._cond = threading.Condition()
        self._queues: "collections.OrderedDict[Any, collections.deque[_Job]]" = collections.OrderedDict()
        self._running: dict[Any, int] = {}
        self._threads: list[threading.Thread] = []
        self._closed = False

    def submit(self, key: Any, fn: Callable[..., T], *args: Any) -> "cf.Future[T]":
        """Queue ``fn(*args)`` under ``key``; returns a concurrent future."""
        future: "cf.Future[T]" = cf.Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("the pool is shut down")
            self._queues.setdefault(key, collections.deque()).append(_Job(future, fn, args))
            if len(self._threads) < self.workers:
                t = threading.Thread(target=self._work, daemon=True,
                                     name=f"{self._name}-{len(self._threads)}")
                self._threads.append(t)
                t.start()
            self._cond.notify()
        return future

    async def run(self, key: Any, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on the pool under ``key`` and await its result."""
        return await asyncio.wrap_future(self.submit(key, fn, *args))

    def queued(self, key: Any = None) -> int:
        """Jobs waiting (of ``key``, or of every key)."""
        with self._cond:
            if key is not None:
                return len(self._queues.get(key, ()))
            return sum(len(q) for q in self._queues.values())

    def _next_job(self) -> Optional[tuple[Any, _Job]]:
        """The next runnable job, round-robin (called with the lock held)."""
        for key in list(self._queues):
            if self._running.get(key, 0) >= self.per_key_limit:
                continue
            queue = self._queues.pop(key)
            job = queue.popleft()
            if queue:
                self._queues[key] = queue  # back of the line: the next key goes first
            return key, job
        return None

    def _work(self) -> None:
        while True:
            with self._cond:
                picked = self._next_job()
                while picked is None:
                    if self._closed:
                        return
                    self._cond.wait()
                    picked = self._next_job()
                key, job = picked
                self._running[key] = self._running.get(key, 0) + 1
            try:
                if job.future.set_running_or_notify_cancel():
                    try:
                        result = job.fn(*job.args)
                    except BaseException as exc:  # noqa: BLE001 - handed to the awaiting caller
                        job.future.set_exception(exc)
                    else:
                        job.future.set_result(result)
            finally:
                with self._cond:
                    left = self._running[key] - 1
                    if left:
                        self._running[key] = left
                    else:
                        del self._running[key]
                    self._cond.notify_all()

    def shutdown(self) -> None:
        """Stop the threads once idle; queued jobs are cancelled."""
        with self._cond:
            self._closed = True
            for queue in self._queues.values():
                for job in queue:
                    job.future.cancel()
            self._queues.clear()
            self._cond.notify_all()
