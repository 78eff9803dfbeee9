"""Run vLLM's own client, ``vllm bench serve``, against several servers, alternated in rounds.

``python -m tools.peers.vllm_bench_serve [--model M] [--vllm] [--server NAME=COMMAND ...]
--concurrency 32,64 --num-prompts 64 --input-len 130 --output-len 64 --rounds 2
--output-dir DIR``

The independent client of issue 34's load figures. Every server is started first (their
``{host}``/``{port}`` filled in, each waited for until ready; ``--vllm`` adds vLLM CPU from
``make bench-peers-vllm`` on the model's bfloat16 export), then each round runs every
concurrency on every server, one server after another, so that a slow or noisy minute hits
all of them alike; each round starts with the next server (over as many rounds as servers,
each runs in every position once), and each run follows ``--pause`` seconds of quiet, since
the server run right after a peer's can meet that peer's threads still busy. Within a round all servers get the same random prompts (one seed per
round and concurrency); no two rounds share prompts, so no server answers from its prefix
cache what an earlier run already computed (``vllm bench serve``'s random dataset repeats
its prompts for a repeated seed). A run that fails stops the tool (exit 1); each finished
run's own JSON stays under ``DIR/runs/``.

Writes ``DIR/results.json`` (every run's figures) and ``DIR/report.md`` (per server and
concurrency: the median over the rounds of output tok/s, TTFT p50/mean/p99 and TPOT p50,
with ratios against ``--reference``, vLLM by default). Each run's own JSON and log stay
under ``DIR/runs/``.
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Optional, Sequence, TypeVar

import httpx

from llmserve.bench.compare import (
    ServerProcess,
    ServerSpec,
    server_spec_from_arg,
    vllm_model_dir,
    vllm_spec,
)
from llmserve.bench.peers import PeerSettings, find_vllm_python

logger = logging.getLogger(__name__)
T = TypeVar("T")

#: The figures kept from a ``vllm bench serve`` result file, under the names it writes.
FIELDS = ("output_throughput", "median_ttft_ms", "mean_ttft_ms", "p99_ttft_ms",
          "median_tpot_ms", "completed")


def bench_serve_command(python: str, base_url: str, model: str, tokenizer: str, *,
                        concurrency: int, num_prompts: int, input_len: int, output_len: int,
                        seed: int, result_dir: Path, result_file: str) -> list[str]:
    """The ``vllm bench serve`` command line of one run: random prompts of exactly
    ``input_len`` tokens, ``output_len`` tokens out (``--ignore-eos``), all sent at once
    under ``concurrency`` open requests, the result saved as JSON."""
    return [python, "-m", "vllm.entrypoints.cli.main", "bench", "serve", "--backend", "openai",
            "--base-url", base_url, "--model", model, "--tokenizer", tokenizer,
            "--dataset-name", "random", "--random-input-len", str(input_len),
            "--random-output-len", str(output_len), "--random-range-ratio", "0",
            "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency),
            "--ignore-eos", "--seed", str(seed), "--save-result",
            "--result-dir", str(result_dir), "--result-filename", result_file]


def run_figures(result: dict) -> dict:
    """The kept figures of one result file; ValueError when the run lost requests."""
    missing = [f for f in FIELDS if f not in result]
    if missing:
        raise ValueError(f"vllm bench serve result lacks {missing}")
    figures = {f: result[f] for f in FIELDS}
    if figures["completed"] != result.get("num_prompts", figures["completed"]):
        raise ValueError(f"only {figures['completed']} of {result['num_prompts']} requests "
                         "completed")
    return figures


def summarize(runs: Sequence[dict], reference: Optional[str]) -> list[dict]:
    """One row per (server, concurrency): each figure's median over the rounds, and the
    throughput and TTFT p50 as ratios to the reference server's medians."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for run in runs:
        groups.setdefault((run["server"], run["concurrency"]), []).append(run["figures"])
    rows = []
    for (server, conc), figs in groups.items():
        row: dict = {"server": server, "concurrency": conc, "rounds": len(figs)}
        for f in FIELDS:
            row[f] = statistics.median(x[f] for x in figs)
        rows.append(row)
    medians = {(r["server"], r["concurrency"]): r for r in rows}
    for row in rows:
        ref = medians.get((reference or "", row["concurrency"]))
        if ref is not None:
            row["throughput_ratio"] = row["output_throughput"] / ref["output_throughput"]
            row["ttft_p50_ratio"] = row["median_ttft_ms"] / ref["median_ttft_ms"]
    return sorted(rows, key=lambda r: (r["concurrency"], r["server"]))


def render_report(rows: Sequence[dict], runs: Sequence[dict], setup: dict) -> str:
    """The Markdown report: the medians table, then every run."""
    ref = setup.get("reference") or "-"
    lines = [
        "# `vllm bench serve` against each server", "",
        f"Random prompts of {setup['input_len']} tokens, {setup['output_len']} out, "
        f"{setup['num_prompts']} requests per run, {setup['rounds']} rounds alternated; "
        f"medians over the rounds; ratios against {ref}.", "",
        "| server | c | output tok/s | x ref | TTFT p50 (ms) | x ref | TTFT mean | TTFT p99 |"
        " TPOT p50 (ms) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        tr = f"{r['throughput_ratio']:.2f}x" if "throughput_ratio" in r else ""
        lr = f"{r['ttft_p50_ratio']:.2f}x" if "ttft_p50_ratio" in r else ""
        lines.append(f"| {r['server']} | {r['concurrency']} | {r['output_throughput']:.1f} | "
                     f"{tr} | {r['median_ttft_ms']:.0f} | {lr} | {r['mean_ttft_ms']:.0f} | "
                     f"{r['p99_ttft_ms']:.0f} | {r['median_tpot_ms']:.1f} |")
    lines += ["", "Every run (round, concurrency, server: output tok/s, TTFT p50 ms):", ""]
    lines += [f"- {x['round']}, c={x['concurrency']}, {x['server']}: "
              f"{x['figures']['output_throughput']:.1f}, {x['figures']['median_ttft_ms']:.0f}"
              for x in runs]
    return "\n".join(lines) + "\n"


def served_model_id(base_url: str) -> str:
    """The first model id a server lists under ``/v1/models``."""
    data = httpx.get(base_url + "/v1/models", timeout=30.0, trust_env=False).json()
    return str(data["data"][0]["id"])


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="GGUF file or HF folder (default model)")
    p.add_argument("--server", action="append", default=[], metavar="NAME=COMMAND")
    p.add_argument("--vllm", action="store_true", help="add vLLM CPU (make bench-peers-vllm)")
    p.add_argument("--reference", default="vllm", help="server the ratios are against")
    p.add_argument("--concurrency", default="32,64")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=130)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--first-seed", type=int, default=1000)
    p.add_argument("--ready-timeout", type=float, default=900.0)
    p.add_argument("--run-timeout", type=float, default=1800.0, help="seconds per client run")
    p.add_argument("--pause", type=float, default=3.0,
                   help="seconds of quiet before each client run (a server's threads settle)")
    p.add_argument("--output-dir", required=True)
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    from llmserve.default_model import resolve_model_path

    try:
        model = resolve_model_path(args.model)
        concurrencies = [int(c) for c in args.concurrency.split(",") if c.strip()]
        python = str(find_vllm_python())   # the client runs from vLLM's venv
        specs = [server_spec_from_arg(item, "--server") for item in args.server]
        if args.vllm:
            longest = args.input_len + args.output_len + 64
            specs.append(vllm_spec(model, PeerSettings(
                parallel=max(concurrencies), context_per_seq=max(1024, -(-longest // 256) * 256))))
        if not specs:
            raise ValueError("no server: give --server NAME=COMMAND and/or --vllm")
        tokenizer = vllm_model_dir(model)
    except Exception as exc:  # noqa: BLE001 - a setup problem is one message and exit 2
        logger.error("%s", exc)
        return 2
    out = Path(args.output_dir)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    runs: list[dict] = []
    try:
        ids = _run_rounds(args, specs, concurrencies, python, tokenizer, out, runs)
    except (RuntimeError, TimeoutError, OSError, ValueError, KeyError, httpx.HTTPError,
            subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        logger.error("%s", exc)
        return 1
    setup = {"model": model, "input_len": args.input_len, "output_len": args.output_len,
             "num_prompts": args.num_prompts, "rounds": args.rounds,
             "reference": args.reference if args.reference in ids else None,
             "servers": {s.name: s.command for s in specs}}
    rows = summarize(runs, setup["reference"])
    (out / "results.json").write_text(json.dumps(
        {"setup": setup, "summary": rows, "runs": runs}, indent=1) + "\n")
    (out / "report.md").write_text(render_report(rows, runs, setup))
    sys.stdout.write(render_report(rows, runs, setup))
    return 0


def round_order(servers: Sequence[T], rnd: int) -> list[T]:
    """The servers in the order round ``rnd`` runs them: each round starts with the next
    one, so over ``len(servers)`` rounds every server runs in every position once (the run
    right after a peer's can meet that peer's threads still busy)."""
    k = rnd % len(servers) if servers else 0
    return [*servers[k:], *servers[:k]]


def _run_rounds(args: argparse.Namespace, specs: Sequence[ServerSpec], concurrencies: list[int],
                python: str, tokenizer: str, out: Path, runs: list[dict]) -> dict[str, str]:
    """Start every server, run the rounds (appending to ``runs``), stop the servers;
    returns each server's model id."""
    with ExitStack() as stack:
        procs = []
        for spec in specs:
            spec.ready_timeout_s = args.ready_timeout
            procs.append(stack.enter_context(ServerProcess(spec, out / f"{spec.name}.log")))
        ids = {p.spec.name: served_model_id(p.url) for p in procs}
        for rnd in range(args.rounds):
            order = round_order(procs, rnd)
            for i, conc in enumerate(concurrencies):
                seed = args.first_seed + rnd * len(concurrencies) + i   # never repeated
                for proc in order:
                    time.sleep(args.pause)
                    name = f"r{rnd}-c{conc}-{proc.spec.name}"
                    cmd = bench_serve_command(
                        python, proc.url, ids[proc.spec.name], tokenizer, concurrency=conc,
                        num_prompts=args.num_prompts, input_len=args.input_len,
                        output_len=args.output_len, seed=seed, result_dir=out / "runs",
                        result_file=f"{name}.json")
                    with open(out / "runs" / f"{name}.log", "wb") as log:
                        subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=True,
                                       timeout=args.run_timeout)
                    result = json.loads((out / "runs" / f"{name}.json").read_text())
                    figures = run_figures(result)
                    runs.append({"round": rnd, "concurrency": conc, "server": proc.spec.name,
                                 "seed": seed, "figures": figures})
                    logger.info("%s: %.1f output tok/s, TTFT p50 %.0f ms", name,
                                figures["output_throughput"], figures["median_ttft_ms"])
    return ids


if __name__ == "__main__":
    raise SystemExit(main())
