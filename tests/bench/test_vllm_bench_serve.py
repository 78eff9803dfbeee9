"""The `vllm bench serve` driver (tools/peers/vllm_bench_serve.py): its command line, the
figures it keeps from a result file, the medians over rounds and the ratios it reports.
Running vLLM itself needs `make bench-peers-vllm` and is a benchmark, not a test."""
from __future__ import annotations

from pathlib import Path

import pytest

from tools.peers.vllm_bench_serve import (
    bench_serve_command,
    main,
    render_report,
    run_figures,
    summarize,
)


def _result(tput: float, ttft: float, completed: int = 64) -> dict:
    return {"output_throughput": tput, "median_ttft_ms": ttft, "mean_ttft_ms": ttft + 1,
            "p99_ttft_ms": ttft * 2, "median_tpot_ms": 30.0, "completed": completed,
            "num_prompts": 64, "duration": 5.0}


def test_command_sends_fixed_length_random_prompts_under_the_concurrency(tmp_path):
    cmd = bench_serve_command("/v/bin/python", "http://127.0.0.1:9", "m", "/tok",
                              concurrency=32, num_prompts=64, input_len=130, output_len=64,
                              seed=1132, result_dir=tmp_path, result_file="r.json")
    flags = dict(zip(cmd[::1], cmd[1:]))
    assert cmd[:5] == ["/v/bin/python", "-m", "vllm.entrypoints.cli.main", "bench", "serve"]
    assert flags["--max-concurrency"] == "32" and flags["--num-prompts"] == "64"
    assert flags["--random-input-len"] == "130" and flags["--random-output-len"] == "64"
    assert flags["--random-range-ratio"] == "0" and flags["--seed"] == "1132"
    assert "--ignore-eos" in cmd and flags["--result-filename"] == "r.json"


def test_a_run_that_lost_requests_or_fields_is_refused():
    assert run_figures(_result(500.0, 900.0))["median_ttft_ms"] == 900.0
    with pytest.raises(ValueError, match="only 60 of 64"):
        run_figures(_result(500.0, 900.0, completed=60))
    bad = _result(500.0, 900.0)
    del bad["p99_ttft_ms"]
    with pytest.raises(ValueError, match="p99_ttft_ms"):
        run_figures(bad)


def test_medians_over_rounds_and_ratios_against_the_reference():
    runs = []
    for rnd, (a, v) in enumerate([((600.0, 400.0), (500.0, 1000.0)),
                                  ((700.0, 500.0), (520.0, 900.0)),
                                  ((650.0, 300.0), (480.0, 1100.0))]):
        runs.append({"round": rnd, "concurrency": 32, "server": "llmserve",
                     "figures": run_figures(_result(*a))})
        runs.append({"round": rnd, "concurrency": 32, "server": "vllm",
                     "figures": run_figures(_result(*v))})
    rows = summarize(runs, "vllm")
    mine = next(r for r in rows if r["server"] == "llmserve")
    assert mine["rounds"] == 3
    assert mine["output_throughput"] == 650.0 and mine["median_ttft_ms"] == 400.0
    assert mine["throughput_ratio"] == pytest.approx(650.0 / 500.0)
    assert mine["ttft_p50_ratio"] == pytest.approx(400.0 / 1000.0)
    text = render_report(rows, runs, {"input_len": 130, "output_len": 64, "num_prompts": 64,
                                      "rounds": 3, "reference": "vllm"})
    assert "| llmserve | 32 | 650.0 | 1.30x | 400 | 0.40x |" in text
    # no reference among the servers: no ratios, and the table still renders
    assert "throughput_ratio" not in summarize(runs, None)[0]


def test_no_server_is_a_message_and_exit_2(tmp_path, monkeypatch, caplog):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    monkeypatch.setattr("tools.peers.vllm_bench_serve.find_vllm_python",
                        lambda: venv / "bin" / "python")
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    assert main(["--model", str(model), "--output-dir", str(tmp_path / "o")]) == 2
    assert "no server" in caplog.text
    assert main(["--model", str(model), "--server", "broken", "--output-dir",
                 str(tmp_path / "o")]) == 2
    assert "NAME=COMMAND" in caplog.text
    assert not Path(tmp_path / "o" / "results.json").exists()


def test_each_round_starts_with_the_next_server():
    from tools.peers.vllm_bench_serve import round_order
    servers = ["llmserve", "before", "vllm"]
    orders = [round_order(servers, r) for r in range(4)]
    assert orders[:3] == [["llmserve", "before", "vllm"], ["before", "vllm", "llmserve"],
                          ["vllm", "llmserve", "before"]]
    assert orders[3] == orders[0]
    # over as many rounds as servers, each server runs in every position once
    for position in range(3):
        assert sorted(o[position] for o in orders[:3]) == sorted(servers)
    assert round_order([], 2) == []
