"""`bench serve` and `bench compare` end to end against fake OpenAI-compatible servers."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from llmserve.bench.cli import main
from llmserve.bench.compare import ServerProcess, ServerSpec, detect_static_batching_args

FAKE_SERVER = str(Path(__file__).with_name("bench_fake_server.py"))
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def assert_valid_png(path: Path) -> None:
    from matplotlib.image import imread

    assert path.read_bytes()[:8] == PNG_SIGNATURE
    img = imread(str(path))
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100


def test_bench_serve_cli(tmp_path, fake_server, bpe_tokenizer_path):
    out = tmp_path / "out"
    with fake_server(fail_requests=frozenset({4})) as srv:
        rc = main(["bench", "serve", "--base-url", srv.url, "--num-prompts", "10",
                   "--input-len", "24", "--output-len", "6", "--range-ratio", "0.5",
                   "--request-rate", "200", "--max-concurrency", "3", "--seed", "5",
                   "--tokenizer", bpe_tokenizer_path, "--slo", "ttft_ms=5000,tpot_ms=5000",
                   "--buckets", "0,24", "--output-dir", str(out), "--no-progress"])
        bodies = srv.server.config.app.state.bench["bodies"]
    assert rc == 0
    results = json.loads((out / "results.json").read_text())
    assert results["schema_version"] == 1 and results["model"] == "fake-model"
    assert results["workload"]["name"] == "random"
    assert results["workload"]["tokenizer"] == "TokenizersFileTokenizer"
    assert results["settings"]["max_concurrency"] == 3 and results["sweep"] is None
    (run,) = results["runs"]
    m = run["metrics"]
    assert (m["num_requests"], m["completed"], m["failed"]) == (10, 9, 1)
    assert m["errors"] == {"503": 1}
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert set(m[key]) >= {"mean", "p50", "p90", "p95", "p99", "max"}
        assert m[key]["count"] >= 9 and m[key]["p50"] > 0
    reqs = run["requests"]
    assert len(reqs) == 10
    ok = [r for r in reqs if r["success"]]
    # exact lengths: the fake honours max_tokens; usage carries the token count
    assert all(r["output_tokens"] == r["expected_output_len"] for r in ok)
    assert m["total_output_tokens"] == sum(r["expected_output_len"] for r in ok)
    assert m["good_requests"] == 9 and m["goodput"] > 0
    by_bucket = {b["bucket"]: b["num_requests"] for b in m["by_input_len"]}
    assert set(by_bucket) <= {"[0, 24)", "[24, inf)"}
    assert by_bucket.get("[0, 24)", 0) == sum(1 for r in reqs if r["input_len"] < 24)
    assert by_bucket.get("[24, inf)", 0) == sum(1 for r in reqs if r["input_len"] >= 24)
    assert all(b["max_tokens"] == b["min_tokens"] and b["ignore_eos"] for b in bodies)
    assert len(bodies) == 10 and all(b["model"] == "fake-model" for b in bodies)
    assert sorted(b["max_tokens"] for b in bodies) == sorted(
        r["expected_output_len"] for r in reqs)
    assert results["files"]["report"] == "report.md"
    assert set(results["files"]["plots"]) == {"latency_cdf.png", "ttft_vs_input_len.png",
                                              "throughput_vs_concurrency.png"}
    for name in results["files"]["plots"]:
        assert_valid_png(out / name)
    md = (out / "report.md").read_text()
    assert "| TTFT (ms) |" in md and "| 503 | 1 |" in md and "![latency_cdf]" in md


def test_bench_serve_is_reproducible(tmp_path, fake_server, bpe_tokenizer_path):
    prompts = []
    for i in range(2):
        with fake_server() as srv:
            main(["bench", "serve", "--base-url", srv.url, "--num-prompts", "4",
                  "--workload", "shared-prefix", "--num-groups", "2", "--prefix-len", "20",
                  "--input-len", "5", "--output-len", "3", "--tokenizer", bpe_tokenizer_path,
                  "--max-concurrency", "1", "--output-dir", str(tmp_path / str(i)),
                  "--no-progress", "--no-plots"])
            prompts.append([b["prompt"] for b in srv.server.config.app.state.bench["bodies"]])
    assert prompts[0] == prompts[1] and len(set(prompts[0])) == 4


def test_bench_serve_sweep_chat(tmp_path, fake_server, bpe_tokenizer_path):
    out = tmp_path / "sweep"
    with fake_server() as srv:
        rc = main(["bench", "serve", "--base-url", srv.url, "--workload", "chat",
                   "--endpoint", "chat", "--num-turns", "2", "--num-prompts", "6",
                   "--input-len", "8", "--output-len", "4", "--tokenizer", bpe_tokenizer_path,
                   "--sweep", "concurrency=1,3", "--output-dir", str(out), "--no-progress"])
        bodies = srv.server.config.app.state.bench["bodies"]
    assert rc == 0
    results = json.loads((out / "results.json").read_text())
    assert results["sweep"] == {"param": "concurrency", "values": [1, 3]}
    assert [r["label"] for r in results["runs"]] == ["concurrency=1", "concurrency=3"]
    assert [r["max_concurrency"] for r in results["runs"]] == [1, 3]
    assert all(r["metrics"]["completed"] == 6 for r in results["runs"])
    assert len(bodies) == 12 and all("messages" in b for b in bodies)
    assert max(len(b["messages"]) for b in bodies) == 3          # user, assistant, user
    assert "sweep.png" in results["files"]["plots"]
    assert_valid_png(out / "sweep.png")
    assert "## Sweep over concurrency" in (out / "report.md").read_text()


def test_bench_serve_rejects_bad_flags(tmp_path):
    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:1", "--sweep", "batch=1",
                 "--output-dir", str(tmp_path)]) == 2
    with pytest.raises(SystemExit):
        main(["bench", "serve", "--base-url", "x", "--request-rate", "0"])


def test_bench_compare_starts_and_stops_servers(tmp_path, bpe_tokenizer_path):
    out = tmp_path / "cmp"
    rc = main(["bench", "compare", "--servers", "none",
               "--extra-server", f"fast={sys.executable} {FAKE_SERVER} --port {{port}}",
               "--extra-server",
               f"slow={sys.executable} {FAKE_SERVER} --port {{port}} --delay 0.02",
               "--extra-server", f"broken={sys.executable} -c 'raise SystemExit(3)'",
               "--num-prompts", "4", "--input-len", "10", "--output-len", "5",
               "--max-concurrency", "2", "--tokenizer", bpe_tokenizer_path,
               "--ready-timeout", "30", "--output-dir", str(out), "--no-progress"])
    assert rc == 1                                    # one server failed to start
    doc = json.loads((out / "compare.json").read_text())
    status = {s["name"]: s["status"] for s in doc["servers"]}
    assert status == {"fast": "ok", "slow": "ok", "broken": "failed"}
    assert "exited with code 3" in doc["servers"][2]["error"]
    assert doc["baseline"] == "fast"
    (ratios,) = doc["ratios"]["slow"]
    fast_m = doc["servers"][0]["runs"][0]["metrics"]
    slow_m = doc["servers"][1]["runs"][0]["metrics"]
    assert ratios["tpot_ms.p50"] == pytest.approx(slow_m["tpot_ms"]["p50"] /
                                                  fast_m["tpot_ms"]["p50"])
    assert ratios["tpot_ms.p50"] > 1.5                # 20 ms vs 2 ms per token
    assert fast_m["completed"] == slow_m["completed"] == 4
    for name in ("fast", "slow"):
        per_server = json.loads((out / name / "results.json").read_text())
        assert per_server["tool"] == "llmserve bench compare"
        assert (out / f"{name}.log").exists()
    md = (out / "compare.md").read_text()
    assert "| Metric | fast | slow | slow / fast |" in md
    for name in doc["files"]["plots"]:
        assert_valid_png(out / name)


def test_server_process_kills_a_server_that_ignores_sigterm(tmp_path):
    code = ("import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print('up', flush=True); time.sleep(60)")
    proc = ServerProcess(ServerSpec("stubborn", [sys.executable, "-c", code]),
                         tmp_path / "stubborn.log")
    proc.start()
    deadline = time.monotonic() + 10
    while b"up" not in (tmp_path / "stubborn.log").read_bytes():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    proc.stop(grace_s=0.5)
    assert proc.proc.returncode == -9


def test_detect_static_batching_args():
    assert detect_static_batching_args("  --static-batching  run one batch") == \
        ["--static-batching"]
    assert detect_static_batching_args("  --batching {continuous,static}") == \
        ["--batching", "static"]
    assert detect_static_batching_args("  --scheduler-policy {fcfs,priority}") is None
    assert detect_static_batching_args("  --max-num-batched-tokens N") is None
