"""``bench serve`` end to end: build the workload, run it (or a sweep), write results.

:func:`run_benchmark` is the library entry point; the CLI maps its flags onto
:class:`BenchOptions`. Output files (in ``output_dir``): ``results.json`` (schema in
:mod:`llmserve.bench.report`), ``report.md`` and the PNG plots of :mod:`llmserve.bench.plots`.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from llmserve.bench import json_validity, plots, report, server_counters
from llmserve.bench.loadgen import LoadResult, run_load
from llmserve.bench.metrics import DEFAULT_BUCKET_EDGES, compute_metrics, concurrency_throughput_series
from llmserve.bench.workloads import RequestSpec, TextTokenizer, build_workload, load_tokenizer

logger = logging.getLogger(__name__)

SWEEP_PARAMS = ("concurrency", "request_rate")


@dataclass
class BenchOptions:
    """Everything ``bench serve`` needs; field names follow the CLI flags."""

    base_url: str
    output_dir: Path = Path("bench-results")
    model: Optional[str] = None
    endpoint: str = "completions"
    workload: str = "random"
    num_prompts: int = 100
    input_len: int = 256
    output_len: int = 128
    range_ratio: float = 0.0
    num_groups: int = 4
    prefix_len: int = 256
    num_turns: int = 3
    dataset: Optional[str] = None
    seed: int = 0
    tokenizer: Optional[str] = None
    request_rate: float = math.inf
    max_concurrency: Optional[int] = None
    ignore_eos: bool = True
    temperature: float = 0.0
    extra_body: dict = field(default_factory=dict)
    slo: dict = field(default_factory=dict)
    bucket_edges: Sequence[int] = DEFAULT_BUCKET_EDGES
    request_timeout_s: float = 600.0
    sweep: Optional[tuple[str, list[float]]] = None
    progress: bool = True
    make_plots: bool = True

    def __post_init__(self) -> None:
        if self.workload == "json-validity" and (self.endpoint != "chat" or self.ignore_eos):
            raise ValueError("the json-validity workload sends chat requests whose answers "
                             "end themselves: use the chat endpoint, without ignore_eos")


def parse_sweep(text: Optional[str]) -> Optional[tuple[str, list[float]]]:
    """``"concurrency=1,4,16"`` -> ("concurrency", [1, 4, 16]); rates may be ``inf``."""
    if not text:
        return None
    param, sep, values = text.partition("=")
    param = param.strip().replace("-", "_")
    if not sep or param not in SWEEP_PARAMS:
        raise ValueError(f"bad --sweep {text!r}; use concurrency=1,4,16 or request_rate=1,2,inf")
    out: list[float] = []
    for v in values.split(","):
        v = v.strip()
        if not v:
            continue
        try:
            x = float(v)
        except ValueError as exc:
            raise ValueError(f"bad --sweep value {v!r}") from exc
        if param == "concurrency" and (math.isinf(x) or x < 1 or x != int(x)):
            raise ValueError(f"concurrency values must be integers >= 1, got {v!r}")
        if x <= 0 or math.isnan(x):
            raise ValueError(f"request_rate values must be > 0 or inf, got {v!r}")
        out.append(int(x) if param == "concurrency" else x)
    if not out:
        raise ValueError(f"--sweep {text!r} has no values")
    return param, out


def make_specs(options: BenchOptions, tokenizer: Optional[TextTokenizer] = None
               ) -> tuple[list[RequestSpec], str]:
    """The workload's requests and the tokenizer's class name."""
    tok = tokenizer if tokenizer is not None else load_tokenizer(options.tokenizer)
    specs = build_workload(
        options.workload, tok, num_prompts=options.num_prompts, input_len=options.input_len,
        output_len=options.output_len, range_ratio=options.range_ratio,
        num_groups=options.num_groups, prefix_len=options.prefix_len,
        num_turns=options.num_turns, dataset=options.dataset, seed=options.seed)
    return specs, type(tok).__name__


def _points(options: BenchOptions) -> list[tuple[str, float, Optional[int]]]:
    if options.sweep is None:
        label = f"rate={report.fmt(float(options.request_rate))},conc={options.max_concurrency}"
        return [(label, options.request_rate, options.max_concurrency)]
    param, values = options.sweep
    if param == "concurrency":
        return [(f"concurrency={int(v)}", options.request_rate, int(v)) for v in values]
    return [(f"request_rate={report.fmt(float(v))}", float(v), options.max_concurrency)
            for v in values]


def run_entry(label: str, rate: float, concurrency: Optional[int], result: LoadResult,
              options: BenchOptions) -> dict:
    """One ``runs[]`` entry of the results JSON."""
    metrics = compute_metrics(result.records, result.duration_s, options.slo,
                              options.bucket_edges)
    return {"label": label, "request_rate": report.jsonable_rate(rate),
            "max_concurrency": concurrency, "started_at": result.started_at,
            "metrics": metrics,
            "timeline": [[round(a, 4), round(b, 3)]
                         for a, b in concurrency_throughput_series(result.records)],
            "requests": [r.to_dict() for r in result.records]}


async def execute_runs(options: BenchOptions, specs: Sequence[RequestSpec]
                       ) -> tuple[list[dict], str]:
    """Run every sweep point in turn against ``options.base_url``; returns (runs, model).

    Each sweep point after the first gets fresh prompts (seed + point index, same length
    distributions), so a server's prefix cache cannot reuse an earlier point's prompts.
    """
    runs, model = [], options.model
    for i, (label, rate, conc) in enumerate(_points(options)):
        point_specs = specs
        if i and options.workload != "jsonl":
            point_specs, _ = make_specs(dataclasses.replace(options, seed=options.seed + i))
        before = await server_counters.scrape(options.base_url)
        result = await run_load(
            options.base_url, point_specs, model=model, endpoint=options.endpoint,
            request_rate=rate, max_concurrency=conc, seed=options.seed,
            ignore_eos=options.ignore_eos, temperature=options.temperature,
            extra_body=options.extra_body, request_timeout_s=options.request_timeout_s,
            progress=options.progress, label=label)
        model = result.model
        entry = run_entry(label, rate, conc, result, options)
        if options.workload == "json-validity":
            scored = json_validity.answers(point_specs, result.records)
            entry["metrics"]["validity"] = json_validity.validity_summary(scored)
            entry["answers"] = scored
        entry["metrics"]["server_counters"] = server_counters.counter_delta(
            before, await server_counters.scrape(options.base_url))
        logger.info("%s", report.summary_line(label, entry["metrics"]))
        runs.append(entry)
    return runs, model or "default"


def results_document(options: BenchOptions, specs: Sequence[RequestSpec], tokenizer_name: str,
                     runs: list[dict], model: str, tool: str = "llmserve bench serve") -> dict:
    """The results JSON around ``runs`` (schema in :mod:`llmserve.bench.report`)."""
    n = max(len(specs), 1)
    return {
        "schema_version": report.SCHEMA_VERSION, "tool": tool, "created": report.utc_now_iso(),
        "base_url": options.base_url, "model": model, "endpoint": options.endpoint,
        "workload": {"name": options.workload, "num_prompts": len(specs),
                     "input_len": options.input_len, "output_len": options.output_len,
                     "range_ratio": options.range_ratio, "num_groups": options.num_groups,
                     "prefix_len": options.prefix_len, "num_turns": options.num_turns,
                     "dataset": options.dataset, "seed": options.seed,
                     "tokenizer": tokenizer_name,
                     "mean_input_len": sum(s.input_len for s in specs) / n,
                     "mean_output_len": sum(s.output_len for s in specs) / n},
        "settings": {"request_rate": report.jsonable_rate(options.request_rate),
                     "max_concurrency": options.max_concurrency,
                     "ignore_eos": options.ignore_eos, "temperature": options.temperature,
                     "extra_body": options.extra_body, "slo": options.slo,
                     "bucket_edges": list(options.bucket_edges)},
        "sweep": (None if options.sweep is None else
                  {"param": options.sweep[0],
                   "values": [report.jsonable_rate(v) for v in options.sweep[1]]}),
        "runs": runs,
        "files": {},
    }


def write_outputs(results: dict, out_dir: Path, make_plots: bool = True) -> dict:
    """Write plots, report.md and results.json into ``out_dir``; returns ``results``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    plot_files = plots.write_all_plots(results, out_dir) if make_plots else []
    report_path = report.write_report(out_dir, results, plot_files)
    results["files"] = {"report": report_path.name, "plots": plot_files}
    report.write_json(out_dir / "results.json", results)
    return results


def run_benchmark(options: BenchOptions, specs: Optional[Sequence[RequestSpec]] = None,
                  tokenizer_name: Optional[str] = None) -> dict:
    """Build the workload (unless given), run it, write the outputs; returns the results."""
    if specs is None:
        specs, tokenizer_name = make_specs(options)
    if not specs:
        raise ValueError("the workload has no requests")
    runs, model = asyncio.run(execute_runs(options, specs))
    results = results_document(options, specs, tokenizer_name or "given", runs, model)
    write_outputs(results, Path(options.output_dir), options.make_plots)
    logger.info("results in %s", Path(options.output_dir) / "results.json")
    return results
