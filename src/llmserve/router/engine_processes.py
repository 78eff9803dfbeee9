"""Start and stop local engine processes for ``serve --data-parallel-size N`` (no torch).

Each replica is ``python -m llmserve.cli engine --port P <engine flags>`` on loopback, with
a per-launch random token (``LLMSERVE_ENGINE_TOKEN``) so other local users cannot drive it.
Children get SIGTERM when this process dies (Linux ``PR_SET_PDEATHSIG``), and
:meth:`EngineProcesses.stop` terminates, waits and reaps them: no orphans, no zombies.
"""
from __future__ import annotations

import ctypes
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from typing import Optional, Sequence

import httpx

logger = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS considers free right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class EngineProcesses:
    """N local engine processes; a context manager that always stops them."""

    def __init__(self, count: int, engine_argv: Sequence[str], *, host: str = "127.0.0.1",
                 threads_per_engine: Optional[int] = None, log_dir: Optional[str] = None,
                 extra_env: Optional[dict[str, str]] = None) -> None:
        if count < 1:
            raise ValueError(f"--data-parallel-size must be at least 1, got {count}")
        self.count, self.host = count, host
        self.engine_argv = list(engine_argv)
        self.threads_per_engine = threads_per_engine
        self.log_dir = log_dir
        self.extra_env = dict(extra_env or {})
        self.token = secrets.token_hex(16)
        self.procs: list[subprocess.Popen] = []
        self.urls: list[str] = []

    def start(self, ready_timeout_s: float = 900.0) -> list[str]:
        """Start every engine, wait until all answer ``/ready``; return their URLs."""
        env = dict(os.environ, LLMSERVE_ENGINE_TOKEN=self.token, PYTHONUNBUFFERED="1",
                   **self.extra_env)
        for i in range(self.count):
            port = free_port(self.host)
            argv = [sys.executable, "-m", "llmserve.cli", "engine", "--host", self.host,
                    "--port", str(port), *self.engine_argv]
            if self.threads_per_engine and "--num-threads" not in self.engine_argv:
                argv += ["--num-threads", str(self.threads_per_engine)]
            out = None
            if self.log_dir:
                os.makedirs(self.log_dir, exist_ok=True)
                out = open(os.path.join(self.log_dir, f"engine-{i}.log"), "ab")
            logger.info("starting engine replica %d on port %d", i, port)
            self.procs.append(subprocess.Popen(argv, env=env, stdout=out,
                                               stderr=subprocess.STDOUT if out else None,
                                               preexec_fn=_die_with_parent))
            if out is not None:
                out.close()
            self.urls.append(f"http://{self.host}:{port}")
        self._wait_ready(ready_timeout_s)
        return list(self.urls)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        pending = set(range(self.count))
        while pending:
            for i in sorted(pending):
                code = self.procs[i].poll()
                if code is not None:
                    raise RuntimeError(f"engine replica {i} exited with code {code} "
                                       "before it was ready (see its log)")
                try:
                    if httpx.get(self.urls[i] + "/ready", timeout=1.0).status_code == 200:
                        pending.discard(i)
                except httpx.HTTPError:
                    pass
            if pending and time.monotonic() > deadline:
                raise RuntimeError(f"engine replicas {sorted(pending)} not ready after "
                                   f"{timeout_s:.0f} s")
            if pending:
                time.sleep(0.2)

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM every engine, wait up to ``grace_s``, SIGKILL the rest; reap all."""
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + grace_s
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("engine pid %d ignored SIGTERM; killing it", p.pid)
                p.kill()
                p.wait()

    def __enter__(self) -> "EngineProcesses":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
