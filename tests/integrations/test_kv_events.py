"""KV events (`--kv-events-config`): a real `llmserve serve` publishes vLLM-format batches
over ZMQ PUB; a SUB here recomputes every block hash from the request's token ids, finds
every stored block announced, every evicted block removed, and the events' view of the
cache predicting the next prefix hit."""
from __future__ import annotations

import hashlib
import re
import time
from array import array
from typing import Any, Iterator

import httpx
import pytest

zmq = pytest.importorskip("zmq")
msgpack = pytest.importorskip("msgpack")

from tests.integrations.serve_process import ServeProcess, free_port  # noqa: E402
from tests.model.tiny_checkpoints import make_tiny_checkpoint  # noqa: E402

BLOCK = 8
POOL = 16          # blocks: 128 token slots, so six 40-token prompts must evict
TOPIC = "kv-events"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny") / "m"))


class Subscriber:
    """A SUB socket that decodes every batch: (seq, ts, events, data_parallel_rank)."""

    def __init__(self, port: int) -> None:
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.batches: list[tuple[int, float, list[Any], int]] = []

    def drain(self, quiet_s: float = 1.0) -> None:
        while self.sock.poll(int(quiet_s * 1000)):
            topic, seq, payload = self.sock.recv_multipart()
            assert topic == TOPIC.encode()
            ts, events, rank = msgpack.unpackb(payload)
            self.batches.append((int.from_bytes(seq, "big"), ts, events, rank))

    def events(self) -> list[list[Any]]:
        return [e for _, _, events, _ in self.batches for e in events]


@pytest.fixture(scope="module")
def served(model: str) -> Iterator[tuple[ServeProcess, Subscriber]]:
    kv_port = free_port()
    config = ('{"enable_kv_cache_events": true, "publisher": "zmq", '
              f'"endpoint": "tcp://*:{kv_port}", "topic": "{TOPIC}"}}')
    server = ServeProcess(model, "--num-kv-blocks", str(POOL), "--block-size", str(BLOCK),
                          "--max-num-seqs", "1", "--max-model-len", "128",
                          "--kv-events-config", config).wait_ready()
    sub = Subscriber(kv_port)
    time.sleep(0.5)   # ZMQ's slow joiner: the subscription reaches the PUB socket
    yield server, sub
    sub.sock.close(0)
    server.stop()


def root_from_log(log: str) -> bytes:
    match = re.search(r"hash-chain root \(no namespace\) ([0-9a-f]{64})", log)
    assert match, log[-2000:]
    return bytes.fromhex(match.group(1))


def llmserve_hashes(root: bytes, tokens: list[int]) -> list[int]:
    """docs/SCALING.md: sha256(parent | int64 token ids), the last 8 bytes big-endian."""
    out, parent = [], root
    for i in range(len(tokens) // BLOCK):
        parent = hashlib.sha256(parent + array("q", tokens[i * BLOCK:(i + 1) * BLOCK]).tobytes()
                                ).digest()
        out.append(int.from_bytes(parent[-8:], "big"))
    return out


def complete(server: ServeProcess, prompt: list[int]) -> dict[str, Any]:
    r = httpx.post(server.url("/v1/completions"), timeout=60,
                   json={"prompt": prompt, "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def test_stored_and_removed_blocks_are_announced(served: tuple[ServeProcess, Subscriber]) -> None:
    server, sub = served
    root = root_from_log(server.output())
    prompts = [[1000 + 50 * p + i for i in range(40)] for p in range(6)]   # 5 full blocks each
    for prompt in prompts:
        complete(server, prompt)
    sub.drain()
    assert [b[0] for b in sub.batches] == list(range(len(sub.batches))), "sequence numbers"
    assert all(rank == 0 for *_, rank in sub.batches)

    stored: dict[int, list[int]] = {}   # wire hash -> its block's token ids
    live: set[int] = set()
    removed: set[int] = set()
    for event in sub.events():
        kind = event[0]
        if kind == "BlockStored":
            _, hashes, parent, tokens, block_size, lora_id, medium, lora_name = event
            assert block_size == BLOCK and lora_id is None and lora_name is None
            assert medium == "GPU" and len(tokens) == BLOCK * len(hashes)
            for j, h in enumerate(hashes):
                stored[h] = tokens[j * BLOCK:(j + 1) * BLOCK]
                live.add(h)
        elif kind == "BlockRemoved":
            assert event[1] and set(event[1]) <= live, "removes only what was announced"
            live -= set(event[1])
            removed |= set(event[1])
    for prompt in prompts:
        expected = llmserve_hashes(root, prompt)
        assert len(expected) == 5
        for i, h in enumerate(expected):
            assert h in stored, f"block {i} of a prompt was never announced"
            assert stored[h] == prompt[i * BLOCK:(i + 1) * BLOCK]
    # 30 blocks through a 16-block pool: the first prompts' blocks were evicted and said so
    assert len(live) <= POOL
    assert len(removed) >= 30 - POOL
    assert set(llmserve_hashes(root, prompts[0])) <= removed

    # the events' view predicts the server's next prefix hit (a 40-token prompt may hit 4 blocks)
    for prompt in (prompts[-1], prompts[0]):
        leading = 0
        for h in llmserve_hashes(root, prompt)[:4]:
            if h not in live:
                break
            leading += 1
        usage = complete(server, prompt)["usage"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        assert cached == leading * BLOCK, (cached, leading)
    assert llmserve_hashes(root, prompts[-1])[0] in live   # the last prompt did hit


def test_a_bad_config_is_a_clear_error(model: str) -> None:
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "llmserve.cli", "serve", "--model", model,
                        "--kv-events-config", '{"enable_kv_cache_events": true, "nope": 1}'],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "unknown key(s) ['nope']" in r.stderr and "Traceback" not in r.stderr
