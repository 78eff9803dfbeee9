"""``bench routing``: prefix-cache hit rate and throughput of replica routing policies.

Runs one workload (default: shared-prefix, 8 groups) against, one after another:

* ``single``: ``llmserve serve`` (one engine, the reference hit rate);
* ``dp<N>-<policy>`` for each ``--routing`` policy: ``llmserve serve
  --data-parallel-size N --routing <policy>`` (N engine processes behind the router).

The hit rate of a server is the growth of its fleet-wide ``llmserve_prefix_cache_hits``
over ``llmserve_prefix_cache_queries`` during the run (read from ``/metrics`` before and
after; the router sums its replicas' counters). Writes ``routing.json`` and
``routing.md`` (ratios against ``single``) to the output folder.

``--kill-replica-after S`` SIGKILLs one replica of each data-parallel server S seconds
into its run: requests that had not started streaming must still succeed (the router
retries them once elsewhere); the table counts failures and how many of them came before
the first token (which should be none).
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import httpx

from llmserve.bench.compare import ServerProcess, ServerSpec
from llmserve.bench.server_counters import parse_counters

logger = logging.getLogger(__name__)


def _prefix_counters(url: str) -> tuple[float, float]:
    """(hits, queries) summed over every series of the server's /metrics."""
    counters = parse_counters(httpx.get(url + "/metrics", timeout=10).text)
    return counters.get("prefix_cache_hits", 0.0), counters.get("prefix_cache_queries", 0.0)


def _kill_one_replica(front_pid: int) -> Optional[int]:
    """SIGKILL the first engine child of a data-parallel front; its pid, or None."""
    try:
        with open(f"/proc/{front_pid}/task/{front_pid}/children", encoding="ascii") as f:
            children = [int(p) for p in f.read().split()]
    except OSError:
        return None
    if not children:
        return None
    os.kill(children[0], signal.SIGKILL)
    logger.warning("killed engine replica pid %d of the front %d", children[0], front_pid)
    return children[0]


def server_specs(model: str, replicas: int, policies: list[str], serve_args: list[str]
                 ) -> list[ServerSpec]:
    """The single-engine reference, then one data-parallel server per policy."""
    base = [sys.executable, "-m", "llmserve.cli", "serve", "--host", "{host}", "--port",
            "{port}", "--model", model, *serve_args]
    specs = [ServerSpec("single", base, ready_paths=("/ready",))]
    for policy in policies:
        specs.append(ServerSpec(f"dp{replicas}-{policy}",
                                base + ["--data-parallel-size", str(replicas),
                                        "--routing", policy], ready_paths=("/ready",)))
    return specs


def run_routing_bench(args: argparse.Namespace) -> dict:
    """Run every server spec; return (and write) the comparison document."""
    from llmserve.bench.cli import options_from_args
    from llmserve.bench.runner import execute_runs, make_specs
    from llmserve.default_model import resolve_model_path

    options = options_from_args(args)
    model = resolve_model_path(args.model)
    options.tokenizer = options.tokenizer or model
    requests, _ = make_specs(options)
    out_dir = Path(options.output_dir)
    rows = []
    for spec in server_specs(model, args.replicas, args.routing.split(","),
                             args.serve_args.split()):
        spec.ready_timeout_s = args.ready_timeout
        proc = ServerProcess(spec, out_dir / f"{spec.name}.log")
        with proc:
            hits0, queries0 = _prefix_counters(proc.url)
            opts = dataclasses.replace(options, base_url=proc.url, model=None,
                                       output_dir=out_dir / spec.name)
            timer = None
            if args.kill_replica_after is not None and spec.name != "single":
                timer = threading.Timer(args.kill_replica_after, _kill_one_replica,
                                        (proc.proc.pid,))
                timer.start()
            runs, _ = asyncio.run(execute_runs(opts, requests))
            if timer is not None:
                timer.cancel()
            time.sleep(2.5)   # the router polls replica counters about once a second
            hits1, queries1 = _prefix_counters(proc.url)
        m = runs[0]["metrics"]
        failed = [r for r in runs[0]["requests"] if not r["success"]]
        queries = queries1 - queries0
        rows.append({"name": spec.name, "command": proc.command,
                     "hit_rate": (hits1 - hits0) / queries if queries else 0.0,
                     "completed": m["completed"], "failed": m["failed"],
                     "failed_before_first_token": sum(r["ttft"] is None for r in failed),
                     "output_token_throughput": m["output_token_throughput"],
                     "request_throughput": m["request_throughput"],
                     "ttft_p50_ms": m["ttft_ms"]["p50"]})
    ref = rows[0]
    for row in rows:
        row["hit_rate_vs_single"] = row["hit_rate"] / ref["hit_rate"] if ref["hit_rate"] else None
        row["throughput_vs_single"] = (row["output_token_throughput"]
                                       / ref["output_token_throughput"])
    doc = {"workload": {"name": options.workload, "num_prompts": options.num_prompts,
                        "num_groups": options.num_groups, "prefix_len": options.prefix_len,
                        "input_len": options.input_len, "output_len": options.output_len,
                        "max_concurrency": options.max_concurrency},
           "replicas": args.replicas, "servers": rows}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "routing.json").write_text(json.dumps(doc, indent=2), encoding="utf-8")
    (out_dir / "routing.md").write_text(render_markdown(doc), encoding="utf-8")
    return doc


def render_markdown(doc: dict) -> str:
    """The comparison table (ratios against the single engine)."""
    lines = ["| server | prefix hit rate | vs single | out tok/s | vs single | "
             "TTFT p50 ms | ok/failed (before 1st token) |", "|---|---|---|---|---|---|---|"]
    for r in doc["servers"]:
        vs = r["hit_rate_vs_single"]
        lines.append(f"| {r['name']} | {r['hit_rate']:.3f} | "
                     f"{'-' if vs is None else f'{vs:.2f}'} | "
                     f"{r['output_token_throughput']:.1f} | {r['throughput_vs_single']:.2f} | "
                     f"{r['ttft_p50_ms'] if r['ttft_p50_ms'] is None else round(r['ttft_p50_ms'])}"
                     f" | {r['completed']}/{r['failed']} ({r['failed_before_first_token']}) |")
    return "\n".join(lines) + "\n"


def add_routing_bench_parser(bsub: "argparse._SubParsersAction") -> None:
    """Register ``bench routing``."""
    from llmserve.bench.cli import _add_load_args, _add_workload_args

    p = bsub.add_parser("routing", help="prefix-cache hit rate and throughput of replica "
                                        "routing policies vs one engine")
    _add_workload_args(p)
    _add_load_args(p)
    p.set_defaults(workload="shared-prefix", num_groups=8, num_prompts=64, input_len=32,
                   output_len=16, max_concurrency=8, output_dir="bench-results/routing")
    p.add_argument("--model", default="default")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--routing", default="prefix,round-robin",
                   help="comma-separated policies to compare (prefix, round-robin, least-loaded)")
    p.add_argument("--serve-args", default="", help="extra `serve` flags for every server")
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument("--kill-replica-after", type=float, default=None, metavar="SECONDS",
                   help="SIGKILL one engine replica of each data-parallel server this long "
                        "into its run (requests not yet streaming must still succeed)")

    def handler(args: argparse.Namespace) -> int:
        logging.getLogger("httpx").setLevel(logging.WARNING)
        doc = run_routing_bench(args)
        sys.stdout.write(render_markdown(doc))
        return 0 if all(r["failed_before_first_token"] == 0 for r in doc["servers"]) else 1

    p.set_defaults(func=handler)
