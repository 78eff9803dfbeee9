"""docs/grafana/llmserve.json: the dashboard fields Grafana reads are well formed, and every
metric a query names is one a real `llmserve serve --config` process exports."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.web.conftest import TENANT_KEY

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "llmserve.json"
PANEL_TYPES = {"row", "stat", "gauge", "timeseries", "table", "bargauge"}
METRIC = re.compile(r"\b(llmserve_[a-z0-9_]+)")
VARIABLE = re.compile(r"\$(?:\{)?([A-Za-z_][A-Za-z0-9_]*)")
SUFFIXES = ("_bucket", "_sum", "_count", "_total")


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text(encoding="utf-8"))


def queries(dashboard: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def test_dashboard_structure(dashboard) -> None:
    assert dashboard["title"] and dashboard["uid"] and isinstance(dashboard["schemaVersion"], int)
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert {"datasource", "model", "tenant"} <= set(variables)
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)) and all(isinstance(i, int) for i in ids)
    occupied: set[tuple[int, int]] = set()
    for panel in dashboard["panels"]:
        assert panel["type"] in PANEL_TYPES and panel["title"], panel
        pos = panel["gridPos"]
        assert all(isinstance(pos[k], int) and pos[k] >= 0 for k in ("h", "w", "x", "y")), panel
        assert pos["w"] >= 1 and pos["h"] >= 1 and pos["x"] + pos["w"] <= 24, panel
        cells = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"])
                 for y in range(pos["y"], pos["y"] + pos["h"])}
        assert not cells & occupied, f"panel {panel['title']!r} overlaps another"
        occupied |= cells
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}"
        assert panel["targets"], panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs))
        for target in panel["targets"]:
            expr = target["expr"]
            assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}")
            for name in VARIABLE.findall(expr):
                assert name in variables or name.startswith("__"), (name, expr)
    assert len(queries(dashboard)) >= 20


def test_every_query_names_an_exported_metric(dashboard, gateway_server) -> None:
    # one tenant request, so the per-namespace prefix-cache series exist too
    r = httpx.post(gateway_server.url("/v1/completions"), timeout=60,
                   headers={"Authorization": f"Bearer {TENANT_KEY}"},
                   json={"prompt": "Grafana", "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200
    text = httpx.get(gateway_server.url("/metrics"), timeout=10).text
    exported = {s.name for family in text_string_to_metric_families(text) for s in family.samples}
    named = {m for expr in queries(dashboard) for m in METRIC.findall(expr)}
    assert len(named) >= 25
    missing = sorted(m for m in named if m not in exported)
    assert not missing, f"metrics in docs/grafana/llmserve.json that /metrics lacks: {missing}"
    bases = {m[: -len(s)] for m in named for s in SUFFIXES if m.endswith(s)}
    histograms = {m for m in bases if m + "_bucket" in named}
    assert {"llmserve_time_to_first_token_seconds",
            "llmserve_inter_token_latency_seconds"} <= histograms
