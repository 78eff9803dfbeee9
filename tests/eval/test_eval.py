"""The quality gate: metrics, the table, and the exit code (tiny random model)."""
from __future__ import annotations

import json

import pytest
import torch

from llmserve import cli
from llmserve.eval import metrics
from llmserve.eval.gate import format_table, run_gate
from llmserve.eval.presets import PRESETS, Thresholds
from llmserve.eval.report import format_gate, gate_for
from tests.model.tiny_checkpoints import make_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("eval")), num_heads=4,
                                num_kv_heads=2, hidden=64, seed=11)


def test_metrics():
    logits = torch.tensor([[2.0, 0.0, -1.0], [0.0, 3.0, 0.0]])
    logp = metrics.log_probs(logits)
    assert metrics.mean_kl(logp, logp) == pytest.approx(0.0, abs=1e-7)
    assert metrics.top1_agreement(logp, metrics.log_probs(-logits)) == 0.0
    nll = metrics.mean_nll(logp, torch.tensor([0, 1]))
    assert nll == pytest.approx(float(-(logp[0, 0] + logp[1, 1]) / 2))
    assert metrics.greedy_agreement([[1, 2, 3, 4]], [[1, 2, 9, 4]]) == 0.5
    assert metrics.greedy_agreement([[1, 2], [3]], [[1, 2], [3]]) == 1.0
    with pytest.raises(ValueError):
        metrics.mean_nll(logp, torch.tensor([0]))


def test_gate_runs_configurations_against_the_reference(tiny_path):
    results = run_gate(tiny_path, ["fp32", "kv-int8", "int8"], max_tokens=48, window=24,
                       continuation_tokens=4)
    assert [r.name for r in results] == ["fp32", "kv-int8", "int8"]
    ref, kv, int8 = results
    assert ref.passed is None and ref.ppl > 1
    assert kv.kv_dtype == "int8" and kv.kv_bytes_per_token < ref.kv_bytes_per_token
    assert kv.top1 > 0.9 and kv.kl < 0.01
    assert int8.quantization.startswith("linear:int8")
    assert int8.weight_bytes < ref.weight_bytes
    table = format_table(results)
    assert "kv-int8" in table and "ref" in table


def test_cli_exits_nonzero_past_a_threshold(tiny_path, monkeypatch, tmp_path, capsys):
    args = ["eval", "--model", tiny_path, "--configs", "kv-int8", "--max-tokens", "32",
            "--window", "16", "--continuation-tokens", "2", "--json", str(tmp_path / "r.json")]
    assert cli.main(args) == 0
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["failed"] == [] and report["results"][1]["name"] == "kv-int8"
    row = report["results"][1]
    gate = gate_for(str(tmp_path / "r.json"), row["quantization"], "int8")
    assert gate["config"] == "kv-int8" and gate["passed"] is True
    assert format_gate(gate).startswith("quality gate: pass (kv-int8 vs fp32")
    assert gate_for(str(tmp_path / "r.json"), row["quantization"], "float16") is None
    strict = PRESETS["kv-int8"].__class__(PRESETS["kv-int8"].settings,
                                          Thresholds(-1.0, 1.01, -1.0))
    monkeypatch.setitem(PRESETS, "kv-int8", strict)
    assert cli.main(args) == 1
    assert "quality gate FAILED: kv-int8" in capsys.readouterr().err
