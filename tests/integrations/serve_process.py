"""`llmserve serve` as a real child process on a free port, for tests that need its
signals, flags and sockets (KV events, graceful drain)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from typing import Optional

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServeProcess:
    """``llmserve serve --model PATH --port P ...``; stderr goes to a temporary file."""

    def __init__(self, model: str, *flags: str, port: Optional[int] = None) -> None:
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        argv = [sys.executable, "-m", "llmserve.cli", "--log-level", "INFO", "serve",
                "--model", model, "--port", str(self.port), "--device", "cpu",
                "--enforce-eager", "--num-threads", "1", *flags]
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def url(self, path: str) -> str:
        return self.base_url + path

    def wait_ready(self, timeout: float = 120.0) -> "ServeProcess":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llmserve serve exited {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url("/ready"), timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"llmserve serve not ready in {timeout}s:\n{self.output()}")

    def output(self) -> str:
        with open(self.log.name, encoding="utf-8", errors="replace") as f:
            return f.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()
        os.unlink(self.log.name)
