"""Connection-level limits (issue 13, defect 10) against a real uvicorn server, with raw
sockets that trickle their head or body; the fair tokenizer pool; limits from flags."""
from __future__ import annotations

import socket
import threading
import time
from typing import Callable, Optional

import httpx
import pytest

from llmserve.cli import build_parser, server_limits_from_args
from llmserve.contract.server_limits import ServerLimits
from llmserve.server.fair_pool import FairThreadPool
from tests.server.conftest import LiveServer
from tests.server.server_fakes import FakeEngine

BODY = b'{"prompt": "hello there", "max_tokens": 3}'


def connect(live: LiveServer) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", live.port), timeout=10)
    sock.settimeout(10)
    return sock


def read_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    chunks = []
    while True:
        try:
            data = sock.recv(65536)
        except (ConnectionResetError, socket.timeout):
            break
        if not data:
            break
        chunks.append(data)
    return b"".join(chunks)


def trickle(sock: socket.socket, data: bytes, every_s: float, stop: threading.Event) -> None:
    for i in range(len(data)):
        if stop.is_set():
            return
        try:
            sock.sendall(data[i:i + 1])
        except OSError:
            return
        time.sleep(every_s)


@pytest.fixture
def limited(start_server: Callable[..., LiveServer]) -> LiveServer:
    limits = ServerLimits(body_read_timeout_s=1.0, header_read_timeout_s=1.0,
                          keep_alive_timeout_s=0.5, max_connections=4)
    return start_server(FakeEngine(), limits=limits)


def test_a_trickled_body_gets_408_and_the_connection_closes(limited: LiveServer) -> None:
    sock = connect(limited)
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(BODY))
    started = time.monotonic()                       # the body deadline counts from here
    sock.sendall(head)
    stop = threading.Event()
    sender = threading.Thread(target=trickle, args=(sock, BODY, 0.2, stop), daemon=True)
    sender.start()
    reply = read_all(sock)
    elapsed = time.monotonic() - started
    stop.set()
    sock.close()
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert b"body_read_timeout" in reply and b"connection: close" in reply.lower()
    assert 0.8 < elapsed < 4.0


def test_a_trickled_head_gets_408_and_the_connection_closes(limited: LiveServer) -> None:
    sock = connect(limited)
    started = time.monotonic()                       # the head timer starts on connect
    stop = threading.Event()
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100 + b"\r\n\r\n"
    threading.Thread(target=trickle, args=(sock, head, 0.1, stop), daemon=True).start()
    reply = read_all(sock)
    stop.set()
    sock.close()
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert 0.8 < time.monotonic() - started < 4.0


def test_an_idle_connection_is_closed(limited: LiveServer) -> None:
    sock = connect(limited)
    started = time.monotonic()
    read_all(sock)                                  # nothing sent: the head timer fires
    assert time.monotonic() - started < 4.0
    sock.close()
    sock = connect(limited)                         # after a response: the keep-alive timer
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    started = time.monotonic()
    reply = read_all(sock)
    assert reply.startswith(b"HTTP/1.1 200") and time.monotonic() - started < 3.0
    sock.close()


def test_connections_above_the_cap_get_503(limited: LiveServer) -> None:
    idle = [connect(limited) for _ in range(4)]
    try:
        time.sleep(0.1)
        assert httpx.get(limited.url("/health"), timeout=5).status_code == 503
    finally:
        for sock in idle:
            sock.close()
    time.sleep(0.2)
    assert httpx.get(limited.url("/health"), timeout=5).status_code == 200


def test_fair_pool_serves_keys_round_robin_with_a_per_key_cap() -> None:
    pool = FairThreadPool(workers=2)
    gate = threading.Event()
    order: list[str] = []
    lock = threading.Lock()

    def job(name: str, wait: Optional[threading.Event] = None) -> str:
        if wait is not None:
            wait.wait(5)
        with lock:
            order.append(name)
        return name

    blocked = [pool.submit("hostile", job, f"h{i}", gate) for i in range(4)]
    time.sleep(0.1)                           # one hostile job runs, the others wait their turn
    assert pool.queued("hostile") == 3
    assert pool.submit("victim", job, "v").result(timeout=2) == "v"   # the free thread
    cancelled = pool.submit("hostile", job, "never")
    cancelled.cancel()
    gate.set()
    assert [f.result(timeout=5) for f in blocked] == ["h0", "h1", "h2", "h3"]
    assert order[0] == "v" and "never" not in order
    pool.shutdown()


def test_limits_come_from_the_config_then_the_flags(tmp_path) -> None:
    args = build_parser().parse_args(["serve", "--body-read-timeout", "3", "--max-connections", "7"])
    gateway = type("G", (), {"config": type("C", (), {"server": ServerLimits(max_body_bytes=99)})()})()
    limits = server_limits_from_args(args, gateway)
    assert (limits.body_read_timeout_s, limits.max_connections, limits.max_body_bytes) == (3.0, 7, 99)
    assert server_limits_from_args(build_parser().parse_args(["serve"])) == ServerLimits()
    with pytest.raises(ValueError):
        ServerLimits(body_read_timeout_s=0)
    kwargs = ServerLimits(max_connections=5, keep_alive_timeout_s=2).uvicorn_kwargs()
    assert kwargs["limit_concurrency"] == 5 and kwargs["timeout_keep_alive"] == 2
