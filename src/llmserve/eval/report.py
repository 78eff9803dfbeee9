"""Attach a quality-gate result to a benchmark report (no torch).

``llmserve eval --json FILE`` writes one row per configuration with its runtime
quantization and KV dtype; a benchmark given that file looks up the row matching its own
engine and reports it beside the speed, so a figure never travels without its quality.
"""
from __future__ import annotations

import json
from typing import Optional


def gate_for(eval_json: str, quantization: str, kv_dtype: str) -> Optional[dict]:
    """The gate row of ``eval_json`` for this runtime quantization and KV dtype, or None.

    Returns ``{"config", "passed", "ppl", "ppl_increase", "top1", "kl", "reference"}``;
    ``passed`` is None for the reference configuration itself.
    """
    with open(eval_json, encoding="utf-8") as f:
        report = json.load(f)
    for row in report.get("results", []):
        if row.get("quantization") == quantization and row.get("kv_dtype") == kv_dtype:
            return {"config": row["name"], "passed": row.get("passed"), "ppl": row["ppl"],
                    "ppl_increase": row.get("ppl_increase", 0.0), "top1": row.get("top1", 1.0),
                    "kl": row.get("kl", 0.0), "reference": report.get("reference")}
    return None


def format_gate(gate: Optional[dict]) -> str:
    if gate is None:
        return "quality gate: no matching configuration in the eval report"
    verdict = {None: "reference", True: "pass", False: "FAIL"}[gate["passed"]]
    return (f"quality gate: {verdict} ({gate['config']} vs {gate['reference']}: PPL "
            f"{gate['ppl']:.3f} ({100 * gate['ppl_increase']:+.2f}%), top-1 {gate['top1']:.3f}, "
            f"KL {gate['kl']:.4f})")
