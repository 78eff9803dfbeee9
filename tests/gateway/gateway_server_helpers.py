"""Helpers for the end-to-end gateway tests: a real `llmserve serve --config` process on a
free 127.0.0.1 port, its config file, its ledger (read straight from SQLite), its
metrics and its request log."""
from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import httpx
import yaml

from llmserve.gateway import hash_api_key
from tests.server.server_helpers import metric_value, wait_until

ROOT = Path(__file__).resolve().parents[2]
SRC = str(ROOT / "src")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_tiny_model(folder: Path, max_position_embeddings: int) -> str:
    """A tiny random Llama checkpoint with the default tokenizer in ``folder``, built in a
    subprocess (so the test process never loads torch for it); returns its path."""
    code = ("import sys; from tests.model.tiny_checkpoints import make_tiny_checkpoint; "
            "make_tiny_checkpoint(sys.argv[1], max_position_embeddings=int(sys.argv[2]))")
    subprocess.run([sys.executable, "-c", code, str(folder), str(max_position_embeddings)],
                   check=True, cwd=ROOT, timeout=300, capture_output=True)
    return str(folder)


def write_config(folder: Path, tenants: dict[str, dict[str, Any]], keys: dict[str, str],
                 **top: Any) -> Path:
    """Write a YAML gateway config; ``keys`` maps tenant -> plain API key (stored hashed)."""
    data = dict(top)
    data["tenants"] = {name: {"keys": [hash_api_key(keys[name])], **body}
                       for name, body in tenants.items()}
    path = folder / "gateway.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


class ServerProcess:
    """`python -m llmserve.cli serve --config CFG ...` as a child process (no gateway
    when ``config`` is None)."""

    def __init__(self, config: Optional[Path], serve_args: Sequence[str], log_path: Path,
                 log_level: str = "INFO") -> None:
        self.config = config
        self.log_level = log_level
        self.serve_args = list(serve_args)
        self.log_path = log_path
        self.proc: Optional[subprocess.Popen] = None
        self.port = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url(self, path: str) -> str:
        return self.base_url + path

    def start(self, timeout: float = 120.0) -> "ServerProcess":
        self.port = free_port()
        config = ["--config", str(self.config)] if self.config is not None else []
        cmd = [sys.executable, "-m", "llmserve.cli", "--log-level", self.log_level, "serve",
               *config, "--port", str(self.port), *self.serve_args]
        env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
        log = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        finally:
            log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url("/ready"), timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"server not ready after {timeout}s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)

    def restart(self) -> None:
        self.stop()
        self.start()

    def log_text(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

    def request_log(self) -> list[dict[str, Any]]:
        """The JSON lines of the `llmserve.requests` logger so far."""
        out = []
        for line in self.log_text().splitlines():
            head, sep, payload = line.partition(" llmserve.requests: ")
            if sep:
                out.append(json.loads(payload))
        return out

    def metric(self, name: str, **labels: str) -> float:
        r = httpx.get(self.url("/metrics"), timeout=5)
        r.raise_for_status()
        return metric_value(r.text, name, **labels)

    def kv_used(self, model: str) -> float:
        return self.metric("llmserve_kv_cache_blocks_used", model=model)

    def wait_kv(self, model: str, expected: float, timeout: float = 10.0) -> bool:
        return wait_until(lambda: self.kv_used(model) == expected, timeout, interval=0.05)

    def wait_idle(self, models: Sequence[str], timeout: float = 15.0) -> None:
        def idle() -> bool:
            return all(self.metric("llmserve_num_requests_running", model=m) == 0
                       and self.metric("llmserve_num_requests_waiting", model=m) == 0 for m in models)
        assert wait_until(idle, timeout, interval=0.05), "engine did not become idle"


def ledger_rows(db: Path, **where: Any) -> list[dict[str, Any]]:
    """Rows of the ledger's usage table (read-only connection), filtered by column values."""
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)
    conn.row_factory = sqlite3.Row
    try:
        rows = [dict(r) for r in conn.execute("SELECT * FROM usage ORDER BY record_id")]
    finally:
        conn.close()
    return [r for r in rows if all(r[k] == v for k, v in where.items())]


def auth(key: str, **extra: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", **extra}


def tiny_model_server(root: Path, max_model_len: int) -> ServerProcess:
    """A started ``llmserve serve`` (no gateway) on a tiny random Llama built under ``root``,
    served as ``tiny`` with one thread; its log is ``root / "server.log"``."""
    from tests.model.tiny_checkpoints import make_tiny_checkpoint

    path = make_tiny_checkpoint(str(root / "tiny"), arch="llama", seed=1)
    server = ServerProcess(None, [
        "--model", path, "--num-kv-blocks", "1024", "--block-size", "16", "--max-model-len",
        str(max_model_len), "--num-threads", "1", "--served-model-name", "tiny"],
        root / "server.log", log_level="WARNING")
    return server.start()
