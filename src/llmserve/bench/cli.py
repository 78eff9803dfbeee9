"""Argument parsing and handlers for ``llmserve bench serve|compare`` and ``llmserve kv-calc``.

The top-level CLI calls :func:`add_bench_subparsers` on the ``bench`` command's subparsers
action and :func:`add_kv_calc_subparser` on its own; each registered parser sets ``func`` to
its handler, which takes the parsed namespace and returns an exit code.
``python -m llmserve.bench.cli ...`` runs the same commands stand-alone.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence

from llmserve.bench.kv_calc import DTYPE_BYTES
from llmserve.bench.metrics import DEFAULT_BUCKET_EDGES, parse_slo
from llmserve.bench.workloads import WORKLOAD_DEFAULTS, WORKLOADS

if TYPE_CHECKING:
    from llmserve.bench.peers import PeerSettings
    from llmserve.bench.runner import BenchOptions
    from llmserve.bench.workloads import RequestSpec

logger = logging.getLogger(__name__)


def _positive_int(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return v


def _rate(text: str) -> float:
    v = float(text)
    if v <= 0 or math.isnan(v):
        raise argparse.ArgumentTypeError(f"must be > 0 or inf, got {text}")
    return v


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--workload", choices=WORKLOADS, default="random")
    g.add_argument("--num-prompts", type=_positive_int, default=100,
                   help="requests per run (json-validity: per schema)")
    g.add_argument("--input-len", type=_positive_int, default=256,
                   help="prompt tokens (random: mean; shared-prefix: suffix; chat: per turn)")
    g.add_argument("--output-len", type=_positive_int, default=128,
                   help="max_tokens per request (json-validity: at most, answers end themselves)")
    g.add_argument("--range-ratio", type=float, default=0.0,
                   help="random: lengths uniform in [L*(1-r), L*(1+r)]")
    g.add_argument("--num-groups", type=_positive_int, default=4, help="shared-prefix: groups")
    g.add_argument("--prefix-len", type=_positive_int, default=256,
                   help="shared-prefix: prefix tokens")
    g.add_argument("--num-turns", type=_positive_int, default=3, help="chat: turns")
    g.add_argument("--dataset", help="jsonl: file of {'prompt': ...} or {'messages': [...]}")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--tokenizer", help="tokenizer path (HF folder, .gguf or tokenizer.json); "
                   "default: the default model's")


def _add_load_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("load and output")
    g.add_argument("--endpoint", choices=("completions", "chat"), default=None,
                   help="default: completions (json-validity: chat)")
    g.add_argument("--request-rate", type=_rate, default=math.inf,
                   help="Poisson arrivals per second; inf sends all at once")
    g.add_argument("--max-concurrency", type=_positive_int, default=None)
    g.add_argument("--sweep", help="concurrency=1,4,16,64 or request_rate=1,2,inf")
    g.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false", default=None,
                   help="let the model stop early (default: exact lengths via ignore_eos; "
                        "json-validity: always stops early)")
    g.add_argument("--temperature", type=float, default=None,
                   help="default 0 (json-validity: 1)")
    g.add_argument("--extra-body", default="{}", help="JSON merged into every request body")
    g.add_argument("--slo", help="goodput SLOs, e.g. ttft_ms=500,tpot_ms=50,e2e_ms=10000")
    g.add_argument("--buckets", help="input-length bucket edges, e.g. 0,128,512,2048")
    g.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    g.add_argument("--output-dir", default="bench-results")
    g.add_argument("--no-progress", dest="progress", action="store_false")
    g.add_argument("--no-plots", dest="make_plots", action="store_false")


def options_from_args(args: argparse.Namespace, base_url: str = "") -> "BenchOptions":
    """BenchOptions from parsed ``bench serve``/``bench compare`` arguments."""
    from llmserve.bench.runner import BenchOptions, parse_sweep

    extra = json.loads(args.extra_body or "{}")
    if not isinstance(extra, dict):
        raise ValueError("--extra-body must be a JSON object")
    edges = (tuple(int(x) for x in args.buckets.split(",") if x.strip()) if args.buckets
             else DEFAULT_BUCKET_EDGES)
    wanted = {"endpoint": "completions", "temperature": 0.0, "ignore_eos": True,
              **WORKLOAD_DEFAULTS.get(args.workload, {})}
    chosen = {k: wanted[k] if getattr(args, k) is None else getattr(args, k) for k in wanted}
    return BenchOptions(
        base_url=base_url, output_dir=Path(args.output_dir),
        model=getattr(args, "served_model", None),
        endpoint=chosen["endpoint"], workload=args.workload, num_prompts=args.num_prompts,
        input_len=args.input_len, output_len=args.output_len, range_ratio=args.range_ratio,
        num_groups=args.num_groups, prefix_len=args.prefix_len, num_turns=args.num_turns,
        dataset=args.dataset, seed=args.seed, tokenizer=args.tokenizer,
        request_rate=args.request_rate, max_concurrency=args.max_concurrency,
        ignore_eos=chosen["ignore_eos"], temperature=chosen["temperature"], extra_body=extra,
        slo=parse_slo(args.slo), bucket_edges=edges, request_timeout_s=args.request_timeout,
        sweep=parse_sweep(args.sweep), progress=args.progress, make_plots=args.make_plots)


def _quiet_http_logs() -> None:
    logging.getLogger("httpx").setLevel(logging.WARNING)


def bench_serve_command(args: argparse.Namespace) -> int:
    """Handler of ``bench serve``."""
    from llmserve.bench.report import summary_line
    from llmserve.bench.runner import make_specs, run_benchmark

    _quiet_http_logs()
    try:
        options = options_from_args(args, args.base_url)
        specs, tokenizer_name = make_specs(options)
    except (ValueError, FileNotFoundError) as exc:
        logger.error("%s", exc)
        return 2
    results = run_benchmark(options, specs, tokenizer_name)
    for run in results["runs"]:
        sys.stdout.write(summary_line(run["label"], run["metrics"]) + "\n")
    sys.stdout.write(f"results: {Path(options.output_dir) / 'results.json'}\n")
    return 0 if all(r["metrics"]["completed"] for r in results["runs"]) else 1


def peer_settings_from_args(args: argparse.Namespace, options: "BenchOptions",
                            specs: Sequence["RequestSpec"]) -> "PeerSettings":
    """Size the peers for this run: the sweep's largest concurrency, the longest request."""
    from llmserve.bench.peers import peer_settings_for

    if options.sweep and options.sweep[0] == "concurrency":
        levels: list[Optional[int]] = [int(v) for v in options.sweep[1]]
    else:
        levels = [options.max_concurrency]
    longest = max((s.input_len + s.output_len for s in specs), default=0)
    return peer_settings_for(
        levels, len(specs), longest, threads=args.peer_threads,
        llama_server_bin=args.llama_server_bin, vllm_python=args.vllm_python,
        extra_llama_server_args=shlex.split(args.llama_server_args or ""),
        extra_vllm_args=shlex.split(args.vllm_args or ""))


def bench_compare_command(args: argparse.Namespace) -> int:
    """Handler of ``bench compare``."""
    from llmserve.bench.compare import builtin_server_specs, run_compare, server_spec_from_arg
    from llmserve.bench.peers import busy_cpu_warning
    from llmserve.bench.runner import make_specs
    from llmserve.default_model import resolve_model_path

    _quiet_http_logs()
    try:
        options = options_from_args(args)
        model = None
        if args.servers != "none" or options.tokenizer is None:
            model = resolve_model_path(args.model)
        if options.tokenizer is None:
            options.tokenizer = model
        specs, tok_name = make_specs(options)
        servers = [] if model is None or args.servers == "none" else builtin_server_specs(
            model, "auto" if args.servers == "auto" else args.servers.split(","),
            peer_settings_from_args(args, options, specs))
        servers += [server_spec_from_arg(item) for item in args.extra_server or []]
        if not servers:
            raise ValueError("no server to compare: use --servers or --extra-server")
        for s in servers:
            s.ready_timeout_s = args.ready_timeout
        warning = busy_cpu_warning()
        if warning:
            logger.warning("%s", warning)
    except (ValueError, FileNotFoundError) as exc:
        logger.error("%s", exc)
        return 2
    doc = run_compare(servers, options, specs, tok_name)
    for s in doc["servers"]:
        validity = [r["metrics"]["validity"]["overall"] for r in s["runs"]
                    if "validity" in r["metrics"]]
        sys.stdout.write(f"{s['name']}: {s['status']}" + (f" ({s['error'].splitlines()[0]})"
                                                           if s["error"] else "")
                         + "".join(f", valid JSON {v['valid']}/{v['total']}" for v in validity)
                         + "\n")
    sys.stdout.write(f"report: {Path(options.output_dir) / 'compare.md'}\n")
    return 0 if all(s["status"] == "ok" for s in doc["servers"]) else 1


def kv_calc_command(args: argparse.Namespace) -> int:
    """Handler of ``kv-calc``."""
    from llmserve.bench.kv_calc import engine_pool_bytes_per_token, kv_report, load_config, render_text

    try:
        config, path, tensor_bytes = load_config(args.model)
        pool = None
        if args.engine_pool:
            try:
                pool = engine_pool_bytes_per_token(config, args.block_size, args.kv_dtype)
            except ImportError as exc:
                logger.warning("engine pool unavailable (%s); using the formula", exc)
        weights_dtype = args.weights_dtype or (
            config.torch_dtype if config.torch_dtype in DTYPE_BYTES else "bfloat16")
        rep = kv_report(config, seq_len=args.seq_len, batch=args.batch, kv_dtype=args.kv_dtype,
                        block_size=args.block_size, weights_dtype=weights_dtype,
                        pool_bytes_per_token=pool, kv_budget_gib=args.kv_cache_gib,
                        model_path=path, gguf_tensor_bytes=tensor_bytes)
    except (ValueError, FileNotFoundError) as exc:
        logger.error("%s", exc)
        return 2
    sys.stdout.write((json.dumps(rep, indent=2) if args.json else render_text(rep)) + "\n")
    return 0


def add_bench_subparsers(subparsers: "argparse._SubParsersAction") -> None:
    """Register ``serve`` and ``compare`` on the ``bench`` command's subparsers action.

    The caller owns the ``bench`` parser (so other ``bench`` commands, such as ``offline``,
    live next to these): ``add_bench_subparsers(bench.add_subparsers(...))``.
    """
    sub = subparsers
    serve = sub.add_parser("serve", help="load-test any OpenAI-compatible server (streaming)")
    serve.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    serve.add_argument("--model", dest="served_model",
                       help="model name in requests (default: first id of /v1/models)")
    _add_workload_args(serve)
    _add_load_args(serve)
    serve.set_defaults(func=bench_serve_command)
    from llmserve.bench.cache_ttft import add_parser as add_caches_parser

    add_caches_parser(sub)
    comp = sub.add_parser("compare", help="start llmserve and peers on loopback, same workload")
    comp.add_argument("--model", default="default", help="model path for every server")
    comp.add_argument("--servers", default="auto",
                      help="auto, none, or a comma list of llmserve, llmserve-no-prefix-cache, "
                           "llmserve-static, llama-server, vllm")
    comp.add_argument("--extra-server", action="append", metavar="NAME=COMMAND",
                      help="another server to start; {port} and {host} are filled in")
    peers = comp.add_argument_group("peers (built by `make bench-peers`)")
    peers.add_argument("--llama-server-bin", default=None,
                       help="llama-server binary (default: $LLMSERVE_LLAMA_SERVER, else the "
                            "build cache)")
    peers.add_argument("--llama-server-args", default="", help="extra args for llama-server")
    peers.add_argument("--vllm-python", default=None,
                       help="Python of vLLM's venv (default: $LLMSERVE_VLLM_PYTHON, else the "
                            "cache's vllm-venv)")
    peers.add_argument("--vllm-args", default="", help="extra args for vLLM's server")
    peers.add_argument("--peer-threads", type=int, default=0,
                       help="CPU threads for the peers (default 0: every core)")
    comp.add_argument("--ready-timeout", type=float, default=600.0,
                      help="seconds to wait for each server")
    _add_workload_args(comp)
    _add_load_args(comp)
    comp.set_defaults(func=bench_compare_command)


def add_kv_calc_subparser(subparsers: "argparse._SubParsersAction") -> argparse.ArgumentParser:
    """Register ``kv-calc``."""
    p = subparsers.add_parser("kv-calc", help="KV-cache and weight memory of a model")
    p.add_argument("--model", default="default", help="HF folder, .gguf file or 'default'")
    p.add_argument("--seq-len", type=_positive_int, default=None,
                   help="tokens per sequence (default: the model's context length)")
    p.add_argument("--batch", type=_positive_int, default=1)
    p.add_argument("--kv-dtype", choices=sorted(DTYPE_BYTES), default="bfloat16")
    p.add_argument("--block-size", type=_positive_int, default=16)
    p.add_argument("--weights-dtype", choices=sorted(DTYPE_BYTES), default=None,
                   help="default: the checkpoint's dtype, else bfloat16")
    p.add_argument("--kv-cache-gib", type=float, default=None,
                   help="also show how many sequences a pool of this size holds")
    p.add_argument("--no-engine-pool", dest="engine_pool", action="store_false",
                   help="skip the engine's own pool figure (which imports torch)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=kv_calc_command)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Stand-alone entry: ``python -m llmserve.bench.cli {bench,kv-calc} ...``."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="python -m llmserve.bench.cli")
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="benchmarks")
    add_bench_subparsers(bench.add_subparsers(dest="bench_command", required=True))
    add_kv_calc_subparser(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
