"""Releases end to end: a real `llmserve serve --config` process over two tiny random
checkpoints ("m-a" and, as the extra engine, "m-b"), the official openai client, and
the `llmserve release` CLI against it.

Releases of the public model "chat": v1 and v2 on m-a (different sampling defaults,
so different fingerprints), v3 on m-b (other weights), and "bad" on m-a with a
max_tokens default the context cannot hold (every request it takes fails with 400
context_length_exceeded -- an honest misconfigured release).
"""
from __future__ import annotations

import concurrent.futures as cf
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

import httpx
import openai
import pytest

from tests.gateway.gateway_server_helpers import SRC, ServerProcess, ledger_rows, write_config
from tests.server.server_helpers import wait_until

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
KEYS = {"acme": "sk-acme-" + uuid.uuid4().hex}
ADMIN = "sk-admin-" + uuid.uuid4().hex


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("releases")
    code = ("import sys; from tests.model.tiny_checkpoints import make_tiny_checkpoint; "
            "make_tiny_checkpoint(sys.argv[1], seed=0); make_tiny_checkpoint(sys.argv[2], seed=1)")
    a, b = str(folder / "tiny-a"), str(folder / "tiny-b")
    subprocess.run([sys.executable, "-c", code, a, b], check=True, cwd=ROOT, timeout=300,
                   capture_output=True)
    from llmserve.gateway import hash_api_key

    releases = {"chat": {
        "stable": "v1", "canary": {"release": "v2", "share": 0.5},
        "versions": {"v1": {"target": "m-a", "sampling": {"max_tokens": 1, "temperature": 0}},
                     "v2": {"target": "m-a", "sampling": {"max_tokens": 2, "temperature": 0}},
                     "v3": {"target": "m-b", "sampling": {"max_tokens": 2}},
                     "bad": {"target": "m-a", "sampling": {"max_tokens": 100000}}},
        "health": {"window_s": 30, "min_requests": 5, "max_error_rate": 0.2},
        "gates": {"max_ttft_p95_ratio": 20, "max_tpot_p95_ratio": 20,
                  "min_throughput_ratio": 0.05, "min_greedy_agreement": 0.9}}}
    config = write_config(folder, {"acme": {}}, KEYS, database="ledger.db",
                          admin={"keys": [hash_api_key(ADMIN)]}, releases=releases)
    server = ServerProcess(config, ["--model", a, "--served-model-name", "m-a",
                                    "--fallback-model", b, "--fallback-name", "m-b",
                                    "--max-model-len", "256", "--num-kv-blocks", "128",
                                    "--num-threads", "1"], folder / "server.log")
    server.db = folder / "ledger.db"  # type: ignore[attr-defined]
    server.tiny_a = a  # type: ignore[attr-defined]
    server.start()
    try:
        yield server
    finally:
        server.stop()


def cli(gw: ServerProcess, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=SRC, LLMSERVE_ADMIN_KEY=ADMIN,
               LLMSERVE_API_KEY=KEYS["acme"])
    return subprocess.run([sys.executable, "-m", "llmserve.cli", "release", *args,
                           "--url", gw.base_url], capture_output=True, text=True, env=env,
                          timeout=300, cwd=ROOT)


def ask(c: openai.OpenAI, **kw: Any) -> Any:
    return c.chat.completions.with_raw_response.create(
        model="chat", messages=[{"role": "user", "content": "Hi"}], **kw)


def test_split_200_requests(gw: ServerProcess) -> None:
    c = openai.OpenAI(base_url=gw.url("/v1"), api_key=KEYS["acme"], max_retries=0)
    counts = {"v1": 0, "v2": 0}
    for _ in range(200):
        raw = ask(c)
        counts[raw.headers["x-llmserve-release"]] += 1
    assert 80 <= counts["v1"] <= 120, counts
    rows = ledger_rows(gw.db)  # type: ignore[attr-defined]
    assert {r["release_id"] for r in rows} == {"v1", "v2"}
    assert sum(r["completion_tokens"] for r in rows if r["release_id"] == "v1") == counts["v1"]
    log = [line for line in gw.request_log() if line.get("release")]
    assert len(log) == 200 and all(len(line["release_fingerprint"]) == 64 for line in log)


def test_bad_canary_rolled_back_within_30s(gw: ServerProcess) -> None:
    done = cli(gw, "split", "chat", "--canary", "bad", "--share", "0.5", "--reason", "try bad")
    assert done.returncode == 0, done.stderr
    c = openai.OpenAI(base_url=gw.url("/v1"), api_key=KEYS["acme"], max_retries=0)
    started, failed = time.monotonic(), 0
    while time.monotonic() - started < 30 and \
            gw.metric("llmserve_release_rollbacks_total", release="bad") == 0:
        try:
            ask(c)
        except openai.BadRequestError as e:
            assert e.code == "context_length_exceeded"
            failed += 1
    assert gw.metric("llmserve_release_rollbacks_total", model="chat", release="bad",
                     reason="error_rate") == 1
    assert time.monotonic() - started < 30 and failed >= 5
    assert gw.metric("llmserve_release_share", release="bad") == 0
    assert all(ask(c).headers["x-llmserve-release"] == "v1" for _ in range(5))
    audit = cli(gw, "audit", "--model", "chat")
    assert audit.returncode == 0 and '"auto_rollback"' in audit.stdout and '"try bad"' in audit.stdout


def test_shadow_logged_not_billed(gw: ServerProcess) -> None:
    assert cli(gw, "split", "chat", "--canary", "v2", "--share", "0",
               "--shadow", "v3", "--shadow-share", "1").returncode == 0
    before = len(ledger_rows(gw.db))  # type: ignore[attr-defined]
    c = openai.OpenAI(base_url=gw.url("/v1"), api_key=KEYS["acme"], max_retries=0)
    ids = [ask(c, max_tokens=4).headers["x-request-id"] for _ in range(4)]
    headers = {"Authorization": f"Bearer {ADMIN}"}

    def shadows() -> list[dict[str, Any]]:
        return httpx.get(gw.url("/admin/releases/shadow?model=chat"), headers=headers).json()["data"]

    assert wait_until(lambda: len(shadows()) >= 4, 30)
    found = {s["request_id"]: s for s in shadows()}
    assert set(ids) <= set(found)
    assert all(found[i]["shadow_release"] == "v3" and found[i]["served_release"] == "v1"
               for i in ids)
    rows = ledger_rows(gw.db)  # type: ignore[attr-defined]
    assert len(rows) == before + 4 and {r["served_model"] for r in rows[before:]} == {"m-a"}
    assert cli(gw, "split", "chat", "--shadow-share", "0").returncode == 0


def test_switch_under_load_and_promote(gw: ServerProcess) -> None:
    c = openai.OpenAI(base_url=gw.url("/v1"), api_key=KEYS["acme"], max_retries=0)
    with cf.ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(ask, c, max_tokens=8) for _ in range(36)]
        time.sleep(0.2)
        assert cli(gw, "split", "chat", "--canary", "v2", "--share", "1").returncode == 0
        assert cli(gw, "promote", "chat").returncode == 0
        results = [f.result() for f in futures]      # any failed request raises here
    assert all(r.http_response.status_code == 200 for r in results)
    assert ask(c).headers["x-llmserve-release"] == "v2"
    rollback = cli(gw, "rollback", "chat", "--to", "v1", "--reason", "back")
    assert rollback.returncode == 0, rollback.stderr
    assert ask(c).headers["x-llmserve-release"] == "v1"


def test_release_check(gw: ServerProcess, capsys: pytest.CaptureFixture,
                       monkeypatch: pytest.MonkeyPatch) -> None:
    from llmserve.cli import build_parser

    monkeypatch.setenv("LLMSERVE_API_KEY", KEYS["acme"])

    def run(*args: str) -> int:
        parsed = build_parser().parse_args(["release", "check", *args, "--config",
                                            str(gw.config), "--url", gw.base_url])
        return parsed.func(parsed)

    small = ["--num-prompts", "4", "--input-len", "16", "--output-len", "4",
             "--concurrency", "2"]
    assert run("v2", "--against", "v1", *small, "--eval-model", gw.tiny_a,  # type: ignore
               "--eval-config", "kv-int8", "--eval-tokens", "32") == 0
    out = capsys.readouterr().out
    assert "PASS  greedy_agreement" in out and "PASS  eval:kv-int8" in out and "PASSED" in out
    assert run("v3", "--against", "v1", *small) == 1             # other weights
    assert "FAIL  greedy_agreement" in capsys.readouterr().out
    assert run("nope", "--against", "v1") == 2
    assert "no release 'nope'" in capsys.readouterr().err
    assert run("v2", "--against", "v2") == 2
    assert run("v2", "--against", "v1", "--eval-config", "int3") == 2
    assert "unknown eval preset 'int3'" in capsys.readouterr().err
