"""Results JSON and Markdown report of ``llmserve bench serve``.

Results JSON (``results.json``), ``schema_version`` 1::

    {
      "schema_version": 1,
      "tool": "llmserve bench serve",
      "created": "2025-01-01T00:00:00+00:00",       # UTC, ISO 8601
      "base_url": "http://127.0.0.1:8000", "model": "...", "endpoint": "completions"|"chat",
      "workload": {"name": "random"|"shared-prefix"|..., "num_prompts": N,
                   "input_len": .., "output_len": .., "range_ratio": .., "num_groups": ..,
                   "prefix_len": .., "num_turns": .., "dataset": .., "seed": ..,
                   "tokenizer": "<class name>", "mean_input_len": .., "mean_output_len": ..},
      "settings": {"request_rate": float|"inf", "max_concurrency": int|null,
                   "ignore_eos": bool, "temperature": float, "slo": {"ttft_ms": ..},
                   "bucket_edges": [0, 64, ...]},
      "sweep": null | {"param": "concurrency"|"request_rate", "values": [...]},
      "runs": [                                       # one per sweep point (one without sweep)
        {"label": "concurrency=4", "request_rate": float|"inf", "max_concurrency": int|null,
         "started_at": unix seconds,
         "timeline": [[mean requests in flight, output tok/s], ...],   # per time window
         "metrics": {                                 # see llmserve.bench.metrics.compute_metrics
           "num_requests", "completed", "failed", "duration_s",
           "total_input_tokens", "total_output_tokens", "mean_in_flight",
           "usage_reported_fraction",
           "request_throughput", "input_token_throughput", "output_token_throughput",
           "total_token_throughput",                  # per second
           "ttft_ms"|"tpot_ms"|"itl_ms"|"e2e_ms": {"count", "mean", "p50", "p90", "p95",
                                                   "p99", "min", "max"},
           "slo", "good_requests", "goodput", "goodput_fraction",
           "errors": {"503": 2, "timeout": 1, ...},
           "by_input_len": [{"bucket": "[128, 256)", "lo", "hi", "num_requests",
                             "completed", "total_input_tokens", "total_output_tokens",
                             "good_requests", "errors", "ttft_ms", "tpot_ms", "itl_ms",
                             "e2e_ms"}],
           "validity": {...}},                        # json-validity only (bench/json_validity.py)
         "requests": [RequestRecord.to_dict(), ...],  # times in seconds
         "answers": [{"id", "schema", "seed", "verdict", "text", ...}]}],  # json-validity only
      "files": {"report": "report.md", "plots": ["latency_cdf.png", ...]}
    }
"""
from __future__ import annotations

import datetime as _dt
import json
import math
from pathlib import Path
from typing import Any, Sequence

from llmserve.bench.server_counters import describe as describe_counters

SCHEMA_VERSION = 1
_LAT_ROWS = (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E", "e2e_ms"))


def jsonable_rate(rate: float) -> Any:
    """JSON has no infinity: an infinite rate is written as the string "inf"."""
    return "inf" if rate is not None and math.isinf(rate) else rate


def utc_now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()


def write_json(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, allow_nan=False) + "\n", encoding="utf-8")


def fmt(x: Any, digits: int = 2) -> str:
    """A table cell: '-' for None, fixed digits for floats."""
    if x is None:
        return "-"
    if isinstance(x, float):
        if math.isinf(x):
            return "inf"
        return f"{x:,.{digits}f}"
    return str(x)


def md_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub-flavoured Markdown table."""
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|"]
    for row in rows:
        cells = [(c if isinstance(c, str) else fmt(c)).replace("|", "\\|") for c in row]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary_table(m: dict) -> str:
    rows = [
        ("Requests (completed / failed)", f"{m['completed']} / {m['failed']}"),
        ("Duration (s)", fmt(m["duration_s"])),
        ("Request throughput (req/s)", fmt(m["request_throughput"], 3)),
        ("Input token throughput (tok/s)", fmt(m["input_token_throughput"])),
        ("Output token throughput (tok/s)", fmt(m["output_token_throughput"])),
        ("Total token throughput (tok/s)", fmt(m["total_token_throughput"])),
        ("Total input / output tokens", f"{m['total_input_tokens']} / {m['total_output_tokens']}"),
    ]
    rows.extend(describe_counters(m.get("server_counters")))
    for t in m.get("turn_reuse") or []:
        cover = "-" if t["coverage"] is None else f"{100 * t['coverage']:.1f}%"
        rows.append((f"Turn {t['turn']}: cached / previous prompt + answer tokens",
                     f"{t['cached_tokens']} / {t['previous_context_tokens']} ({cover})"))
    if m.get("slo"):
        slo = ", ".join(f"{k}<={fmt(v, 0)}" for k, v in m["slo"].items())
        rows.append((f"Goodput (req/s, {slo})", fmt(m["goodput"], 3)))
        rows.append(("Requests meeting the SLO", f"{m['good_requests']} "
                     f"({100 * m['goodput_fraction']:.1f}%)"))
    return md_table(("Metric", "Value"), rows)


def latency_table(m: dict) -> str:
    rows = []
    for name, key in _LAT_ROWS:
        s = m[key]
        rows.append((f"{name} (ms)", s["count"], s["mean"], s["p50"], s["p90"], s["p95"],
                     s["p99"], s["max"]))
    return md_table(("Latency", "n", "mean", "p50", "p90", "p95", "p99", "max"), rows)


def errors_table(m: dict) -> str:
    if not m["errors"]:
        return "No failed requests."
    return md_table(("Error", "Count"), sorted(m["errors"].items()))


def buckets_table(m: dict) -> str:
    rows = []
    for b in m["by_input_len"]:
        rows.append((b["bucket"], b["num_requests"], b["completed"], b["ttft_ms"]["p50"],
                     b["ttft_ms"]["p99"], b["tpot_ms"]["p50"], b["tpot_ms"]["p99"],
                     b["itl_ms"]["p50"], b["e2e_ms"]["p50"], b["e2e_ms"]["p99"]))
    return md_table(("Input tokens", "n", "ok", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99",
                     "ITL p50", "E2E p50", "E2E p99"), rows)


def sweep_table(results: dict) -> str:
    rows = []
    for run in results["runs"]:
        m = run["metrics"]
        rows.append((run["label"], f"{m['completed']}/{m['num_requests']}",
                     m["request_throughput"], m["output_token_throughput"], m["ttft_ms"]["p50"],
                     m["ttft_ms"]["p99"], m["tpot_ms"]["p50"], m["tpot_ms"]["p99"],
                     m["e2e_ms"]["p50"], m["goodput"]))
    return md_table(("Point", "ok/total", "req/s", "out tok/s", "TTFT p50 ms", "TTFT p99 ms",
                     "TPOT p50 ms", "TPOT p99 ms", "E2E p50 ms", "goodput req/s"), rows)


def render_markdown(results: dict, plots: Sequence[str] = ()) -> str:
    """The Markdown report of a results dict (see the module docstring)."""
    w, s = results["workload"], results["settings"]
    out = [f"# Serving benchmark: {results['model']}", "",
           f"Server `{results['base_url']}`, endpoint `{results['endpoint']}`, "
           f"created {results['created']}. Metrics are measured at the client "
           "(definitions in docs/BENCH_TOOL.md).", "", "## Setup", "",
           md_table(("Setting", "Value"), [
               ("Workload", w["name"]), ("Requests", str(w["num_prompts"])),
               ("Mean input / output tokens",
                f"{fmt(w.get('mean_input_len'), 1)} / {fmt(w.get('mean_output_len'), 1)}"),
               ("Request rate (req/s)", str(s["request_rate"])),
               ("Max concurrency", str(s["max_concurrency"])),
               ("ignore_eos", str(s["ignore_eos"])), ("Seed", str(w["seed"])),
               ("Tokenizer", str(w.get("tokenizer")))]), ""]
    if results.get("sweep"):
        out += [f"## Sweep over {results['sweep']['param']}", "", sweep_table(results), ""]
    for run in results["runs"]:
        m = run["metrics"]
        title = f"## Run {run['label']}" if len(results["runs"]) > 1 else "## Results"
        out += [title, "", summary_table(m), "", "### Latency", "", latency_table(m), "",
                "### Errors", "", errors_table(m), "", "### By input length", "",
                buckets_table(m), ""]
        if m.get("validity"):
            from llmserve.bench.json_validity import validity_markdown

            out += ["### JSON validity", "", validity_markdown([("server", m["validity"])]), ""]
    if plots:
        out += ["## Plots", ""] + [f"![{Path(p).stem}]({p})" for p in plots] + [""]
    return "\n".join(out)


def summary_line(label: str, m: dict) -> str:
    """One log line per run."""
    return (f"{label}: {m['completed']}/{m['num_requests']} ok, "
            f"{m['request_throughput']:.2f} req/s, {m['output_token_throughput']:.1f} out tok/s, "
            f"TTFT p50 {fmt(m['ttft_ms']['p50'])} ms, TPOT p50 {fmt(m['tpot_ms']['p50'])} ms, "
            f"errors {m['errors'] or 'none'}"
            + (f", valid JSON {m['validity']['overall']['valid']}/"
               f"{m['validity']['overall']['total']}" if m.get("validity") else ""))


def write_report(out_dir: Path, results: dict, plots: Sequence[str],
                 name: str = "report.md") -> Path:
    path = out_dir / name
    path.write_text(render_markdown(results, plots), encoding="utf-8")
    return path


