"""`serve --data-parallel-size 2`: every generation response names the replica that served
it in `x-llmserve-replica`, streamed or not; round-robin spreads them over both."""
from __future__ import annotations

import httpx
import pytest

from llmserve.router.replica_header import REPLICA_HEADER
from tests.integrations.serve_process import ServeProcess
from tests.model.tiny_checkpoints import make_tiny_checkpoint


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    model = make_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny") / "m"))
    proc = ServeProcess(model, "--data-parallel-size", "2", "--routing", "round-robin",
                        "--num-kv-blocks", "64").wait_ready(240)
    yield proc
    proc.stop()


def test_every_response_names_its_replica(server: ServeProcess) -> None:
    seen = []
    for i in range(4):
        r = httpx.post(server.url("/v1/completions"), timeout=60,
                       json={"prompt": [5, 6, 7 + i], "max_tokens": 2})
        assert r.status_code == 200, r.text
        seen.append(r.headers[REPLICA_HEADER])
    with httpx.stream("POST", server.url("/v1/chat/completions"), timeout=60, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "stream": True}) as r:
        assert r.status_code == 200
        seen.append(r.headers[REPLICA_HEADER])
        r.read()
    assert set(seen) == {"r0", "r1"}, seen
    # nothing was routed: no replica to name
    assert REPLICA_HEADER not in httpx.get(server.url("/health"), timeout=5).headers
