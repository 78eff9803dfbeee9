"""The comparison document (``compare.json``) and its Markdown (``compare.md``).

``compare.json``, ``schema_version`` 1::

    {"schema_version": 1, "tool": "llmserve bench compare", "created": ISO time,
     "workload": {...}, "settings": {...},        # as in results.json, from the first server
     "baseline": "llmserve",                      # first server that ran; ratios are vs it
     "servers": [{"name", "status": "ok"|"failed", "error", "command", "model",
                  "results_file": "llmserve/results.json",
                  "runs": [{"label", "metrics": {...}}]}],        # no per-request data here
     "ratios": {"<server>": [{"label", "<metric key>": value / baseline value | null,
                              "validity": {"<schema>"|"overall": valid share ratio}}]},
                                                  # "validity": json-validity runs only
     "files": {"report": "compare.md", "plots": [...]}}

Ratio keys are the rows of :data:`COMPARE_ROWS` (e.g. ``output_token_throughput``,
``ttft_ms.p50``). A ratio > 1 is better for throughputs and worse for latencies.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

from llmserve.bench.json_validity import validity_markdown
from llmserve.bench.report import SCHEMA_VERSION, fmt, md_table, utc_now_iso

#: (metric key, label, higher is better) rows of the side-by-side table.
COMPARE_ROWS: tuple[tuple[str, str, bool], ...] = (
    ("completed", "Completed requests", True),
    ("failed", "Failed requests", False),
    ("request_throughput", "Request throughput (req/s)", True),
    ("output_token_throughput", "Output tokens/s", True),
    ("total_token_throughput", "Total tokens/s", True),
    ("goodput", "Goodput (req/s)", True),
    ("ttft_ms.mean", "TTFT mean (ms)", False),
    ("ttft_ms.p50", "TTFT p50 (ms)", False),
    ("ttft_ms.p99", "TTFT p99 (ms)", False),
    ("tpot_ms.p50", "TPOT p50 (ms)", False),
    ("tpot_ms.p99", "TPOT p99 (ms)", False),
    ("itl_ms.p50", "ITL p50 (ms)", False),
    ("itl_ms.p99", "ITL p99 (ms)", False),
    ("e2e_ms.p50", "E2E p50 (ms)", False),
    ("e2e_ms.p99", "E2E p99 (ms)", False),
)


def metric_value(metrics: dict, key: str) -> Optional[float]:
    """``metrics["ttft_ms"]["p50"]`` for key ``"ttft_ms.p50"``; None when absent."""
    node: Any = metrics
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node if isinstance(node, (int, float)) else None


def ratio(value: Optional[float], base: Optional[float]) -> Optional[float]:
    if value is None or base is None or base == 0:
        return None
    return value / base


def validity_ratios(metrics: dict, base: dict) -> dict:
    """``{"validity": {schema | "overall": valid share / the baseline's}}`` when both runs
    carry a json-validity summary, else ``{}``."""
    if "validity" not in metrics or "validity" not in base:
        return {}
    mine, theirs = metrics["validity"], base["validity"]
    keys = list(theirs["schemas"]) + ["overall"]
    return {"validity": {key: ratio(
        metric_value(mine, "overall.valid_share" if key == "overall"
                     else f"schemas.{key}.valid_share"),
        metric_value(theirs, "overall.valid_share" if key == "overall"
                     else f"schemas.{key}.valid_share")) for key in keys}}


def comparison_document(entries: list[dict], workload: dict, settings: dict) -> dict:
    """Build compare.json's content from per-server entries (see the module docstring)."""
    ok = [e for e in entries if e["status"] == "ok"]
    servers = []
    for e in entries:
        runs = ([{"label": r["label"], "metrics": r["metrics"]} for r in e["results"]["runs"]]
                if e["status"] == "ok" else [])
        servers.append({"name": e["name"], "status": e["status"], "error": e["error"],
                        "command": e.get("command"), "model": e.get("model"),
                        "results_file": e.get("results_file"), "runs": runs})
    ratios: dict[str, list[dict]] = {}
    if ok:
        base_runs = servers[entries.index(ok[0])]["runs"]
        for s in servers:
            if s["status"] != "ok" or s["name"] == ok[0]["name"]:
                continue
            ratios[s["name"]] = [
                {"label": run["label"], **{key: ratio(metric_value(run["metrics"], key),
                                                      metric_value(base["metrics"], key))
                                           for key, _, _ in COMPARE_ROWS},
                 **validity_ratios(run["metrics"], base["metrics"])}
                for run, base in zip(s["runs"], base_runs)]
    return {
        "schema_version": SCHEMA_VERSION, "tool": "llmserve bench compare",
        "created": utc_now_iso(),
        "workload": workload, "settings": settings,
        "baseline": ok[0]["name"] if ok else None,
        "servers": servers, "ratios": ratios,
    }


def side_by_side_table(doc: dict, run_index: int) -> str:
    ok = [s for s in doc["servers"] if s["status"] == "ok" and len(s["runs"]) > run_index]
    base = ok[0]
    header = ["Metric"] + [s["name"] for s in ok] + [f"{s['name']} / {base['name']}"
                                                     for s in ok[1:]]
    rows = []
    for key, label, higher_better in COMPARE_ROWS:
        values = [metric_value(s["runs"][run_index]["metrics"], key) for s in ok]
        ratios = [ratio(v, values[0]) for v in values[1:]]
        arrow = " (higher is better)" if higher_better else ""
        rows.append([label + arrow] + [fmt(v) for v in values]
                    + [("-" if r is None else f"{r:.2f}x") for r in ratios])
    return md_table(header, rows)


def buckets_side_by_side(doc: dict, run_index: int) -> str:
    ok = [s for s in doc["servers"] if s["status"] == "ok" and len(s["runs"]) > run_index]
    buckets: dict[str, dict[str, Optional[float]]] = {}
    for s in ok:
        for b in s["runs"][run_index]["metrics"]["by_input_len"]:
            buckets.setdefault(b["bucket"], {})[s["name"]] = b["ttft_ms"]["p50"]
    header = ["Input tokens"] + [f"{s['name']} TTFT p50 (ms)" for s in ok]
    rows = [[bucket] + [fmt(vals.get(s["name"])) for s in ok] for bucket, vals in buckets.items()]
    return md_table(header, rows)


def _error_summary(error: Optional[str]) -> str:
    """First and last non-empty lines of an error (the cause is often at the end of a log)."""
    lines = [ln.strip() for ln in (error or "").splitlines() if ln.strip()]
    if not lines:
        return ""
    text = lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"
    return text[:300]


def render_comparison(doc: dict, plot_files: Sequence[str] = ()) -> str:
    """compare.md: setup, failed servers, then per run label the side-by-side tables."""
    w = doc["workload"]
    out = ["# Server comparison", "",
           f"Created {doc['created']}. Same workload on every server, one server at a time; "
           f"ratios are against **{doc['baseline'] or '-'}**. Metrics are measured at the client "
           "(definitions in docs/BENCH_TOOL.md).", "",
           md_table(("Setting", "Value"), [
               ("Workload", str(w.get("name"))), ("Requests", str(w.get("num_prompts"))),
               ("Mean input / output tokens",
                f"{fmt(w.get('mean_input_len'), 1)} / {fmt(w.get('mean_output_len'), 1)}"),
               ("Request rate", str(doc["settings"].get("request_rate"))),
               ("Max concurrency", str(doc["settings"].get("max_concurrency")))]), "",
           "## Servers", "",
           md_table(("Server", "Status", "Command / error"),
                    [(s["name"], s["status"],
                      "`" + " ".join(s["command"] or []) + "`" if s["status"] == "ok"
                      else _error_summary(s["error"])) for s in doc["servers"]]),
           ""]
    ok = [s for s in doc["servers"] if s["status"] == "ok"]
    if ok:
        for i, run in enumerate(ok[0]["runs"]):
            title = f"## {run['label']}" if len(ok[0]["runs"]) > 1 else "## Results"
            out += [title, "", side_by_side_table(doc, i), "", "### TTFT by input length", "",
                    buckets_side_by_side(doc, i), ""]
            with_validity = [(s["name"], s["runs"][i]["metrics"]["validity"]) for s in ok
                             if len(s["runs"]) > i and "validity" in s["runs"][i]["metrics"]]
            if with_validity:
                out += ["### JSON validity", "", "Valid answers (parse and validate against "
                        "the schema); the ratio is of the valid shares.", "",
                        validity_markdown(with_validity), ""]
    else:
        out += ["No server completed the run.", ""]
    if plot_files:
        out += ["## Plots", ""] + [f"![{p}]({p})" for p in plot_files] + [""]
    return "\n".join(out)
