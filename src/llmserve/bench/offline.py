"""Offline benchmarks run in-process, side by side in one run (figures are ratios).

* ``llmserve bench offline``: N requests with seeded input/output lengths (ignore_eos, so
  lengths are exact) through (a) llmserve's continuous batching and (b) Hugging Face
  ``transformers`` ``generate`` in static, left-padded batches of the same concurrency, on
  the same model. Prints output tokens/s of each and their ratio.
* ``llmserve bench prefix``: requests sharing a ~1,000-token system prefix with distinct
  suffixes, prefix cache on vs off: mean time to first token and total throughput.
"""
from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import time
from dataclasses import dataclass
from typing import Callable

logger = logging.getLogger(__name__)


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(n: int, input_range: tuple[int, int], output_range: tuple[int, int],
                  vocab: int, seed: int, output_dist: str = "uniform",
                  output_mean: float = 64.0) -> Workload:
    """Seeded random token-id prompts (ids 1000..vocab-1 avoid special tokens).

    Input lengths are uniform over ``input_range``. Output lengths are uniform over
    ``output_range``, or, with ``output_dist="exponential"``, exponential with mean
    ``output_mean`` clipped to ``output_range`` (long-tailed, like chat answers).
    """
    rng = random.Random(seed)
    prompts = [[rng.randrange(1000, vocab) for _ in range(rng.randint(*input_range))]
               for _ in range(n)]
    lo, hi = output_range
    if output_dist == "uniform":
        outs = [rng.randint(lo, hi) for _ in range(n)]
    elif output_dist == "exponential":
        outs = [min(hi, max(lo, round(rng.expovariate(1.0 / output_mean)))) for _ in range(n)]
    else:
        raise ValueError(f"unknown output distribution {output_dist!r}")
    return Workload(prompts, outs)


def run_llmserve(llm, wl: Workload) -> dict:
    from llmserve.sampling_params import SamplingParams

    eng = llm.engine
    t0 = time.perf_counter()
    first: dict[str, float] = {}
    for i, (p, o) in enumerate(zip(wl.prompts, wl.output_lens)):
        eng.add_request(f"b{i}", p, SamplingParams(max_tokens=o, min_tokens=o, temperature=0,
                                                   ignore_eos=True))
    produced = 0
    while eng.has_unfinished_requests():
        for d in eng.step():
            n = sum(len(c.token_ids) for c in d.outputs)
            if n and d.request_id not in first:
                first[d.request_id] = time.perf_counter() - t0
            produced += n
    dt = time.perf_counter() - t0
    if produced != wl.num_output_tokens:
        raise RuntimeError(f"llmserve produced {produced} tokens, expected {wl.num_output_tokens}")
    return {"seconds": dt, "output_tokens": produced, "output_tok_s": produced / dt,
            "mean_ttft_s": statistics.fmean(first.values())}


def run_transformers_static(model_path: str, wl: Workload, batch_size: int,
                            dtype: str = "float32") -> dict:
    """Static batching baseline: left-padded batches in arrival order, each run to its longest."""
    import torch

    from llmserve.bench.hf_baseline import load_transformers_model

    hf = load_transformers_model(model_path, dtype)
    pad = 0
    t0 = time.perf_counter()
    useful = 0
    for s in range(0, len(wl.prompts), batch_size):
        batch = wl.prompts[s:s + batch_size]
        outs = wl.output_lens[s:s + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        longest = max(outs)
        with torch.no_grad():
            hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=longest,
                        min_new_tokens=longest, do_sample=False, pad_token_id=pad)
        useful += sum(outs)
    dt = time.perf_counter() - t0
    return {"seconds": dt, "output_tokens": useful, "output_tok_s": useful / dt}


def cmd_offline(args: argparse.Namespace, make_config: Callable) -> int:
    from llmserve.llm import LLM

    cfg = make_config(args)
    llm = LLM(**cfg.flags())
    vocab = llm.engine.model_config.vocab_size
    wl = make_workload(args.num_prompts, (args.input_min, args.input_max),
                       (args.output_min, args.output_max), vocab, args.seed,
                       args.output_dist, args.output_mean)
    # warm-up so neither side pays one-time costs in the measurement
    run_llmserve(llm, make_workload(2, (8, 16), (4, 4), vocab, args.seed + 1))
    ours = run_llmserve(llm, wl)
    result = {"workload": {"num_prompts": args.num_prompts,
                           "input_tokens": [args.input_min, args.input_max],
                           "output_tokens": [args.output_min, args.output_max],
                           "output_dist": args.output_dist, "output_mean": args.output_mean,
                           "seed": args.seed, "concurrency": cfg.scheduler.max_num_seqs,
                           "dtype": llm.engine.dtype, "kv_dtype": llm.engine.kv_dtype,
                           "quantization": llm.engine.runner.quantization},
              "llmserve": ours}
    print(f"llmserve      : {ours['output_tok_s']:8.1f} output tok/s "
          f"({ours['output_tokens']} tokens in {ours['seconds']:.1f}s; "
          f"{llm.engine.runner.quantization}, kv {llm.engine.kv_dtype})")
    if args.eval_json:
        from llmserve.eval.report import format_gate, gate_for

        result["quality_gate"] = gate_for(args.eval_json, llm.engine.runner.quantization,
                                          llm.engine.kv_dtype)
        print(format_gate(result["quality_gate"]))
    if not args.skip_baseline:
        base = run_transformers_static(llm.engine.model_path, wl, cfg.scheduler.max_num_seqs,
                                       llm.engine.dtype)
        result["transformers_static"] = base
        result["ratio"] = ours["output_tok_s"] / base["output_tok_s"]
        print(f"transformers  : {base['output_tok_s']:8.1f} output tok/s "
              f"({base['output_tokens']} useful tokens in {base['seconds']:.1f}s, "
              f"static batches of {cfg.scheduler.max_num_seqs})")
        print(f"ratio         : {result['ratio']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def run_prefix_workload(llm, prefix: list[int], suffixes: list[list[int]], max_tokens: int) -> dict:
    """Requests one after another (so TTFT is pure prefill), then all at once for throughput."""
    from llmserve.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, temperature=0,
                            ignore_eos=True)
    eng = llm.engine
    ttfts, cached = [], []
    for i, suf in enumerate(suffixes):
        t0 = time.perf_counter()
        eng.add_request(f"p{i}", prefix + suf, params)
        got_first = False
        while eng.has_unfinished_requests():
            for d in eng.step():
                if not got_first and any(c.token_ids for c in d.outputs):
                    ttfts.append(time.perf_counter() - t0)
                    got_first = True
                if d.finished:
                    cached.append(d.num_cached_tokens)
    t0 = time.perf_counter()
    for i, suf in enumerate(suffixes):
        eng.add_request(f"q{i}", prefix + suf, params)
    produced = 0
    while eng.has_unfinished_requests():
        for d in eng.step():
            produced += sum(len(c.token_ids) for c in d.outputs)
    dt = time.perf_counter() - t0
    return {"mean_ttft_s": statistics.fmean(ttfts[1:] or ttfts), "first_ttft_s": ttfts[0],
            "mean_cached_tokens": statistics.fmean(cached[1:] or cached),
            "throughput_tok_s": (produced + len(suffixes) * (len(prefix) + len(suffixes[0]))) / dt,
            "output_tok_s": produced / dt}


def cmd_prefix(args: argparse.Namespace, make_config: Callable) -> int:

    from llmserve.llm import LLM

    base_cfg = make_config(args)
    rng = random.Random(args.seed)
    results = {}
    for label, enabled in (("prefix_cache_on", True), ("prefix_cache_off", False)):
        cfg = base_cfg.replace(enable_prefix_caching=enabled)
        llm = LLM(**cfg.flags())
        vocab = llm.engine.model_config.vocab_size
        rng = random.Random(args.seed)
        prefix = [rng.randrange(1000, vocab) for _ in range(args.prefix_len)]
        suffixes = [[rng.randrange(1000, vocab) for _ in range(args.suffix_len)]
                    for _ in range(args.num_prompts)]
        run_prefix_workload(llm, [5] * 8, [[6] * 4], 2)  # warm-up
        llm.reset_prefix_cache()
        results[label] = run_prefix_workload(llm, prefix, suffixes, args.output_len)
        r = results[label]
        print(f"{label:17s}: mean TTFT {r['mean_ttft_s'] * 1000:8.1f} ms  "
              f"cached {r['mean_cached_tokens']:6.0f} tok  throughput {r['throughput_tok_s']:8.1f} tok/s")
        del llm
    on, off = results["prefix_cache_on"], results["prefix_cache_off"]
    results["ttft_speedup"] = off["mean_ttft_s"] / on["mean_ttft_s"]
    results["throughput_ratio"] = on["throughput_tok_s"] / off["throughput_tok_s"]
    print(f"TTFT hit vs miss: {results['ttft_speedup']:.1f}x lower; "
          f"throughput {results['throughput_ratio']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def add_offline_bench_parser(bsub, add_engine_args: Callable, make_config: Callable) -> None:
    """Register `bench offline` and `bench prefix` under the `bench` sub-parser."""
    o = bsub.add_parser("offline", help="llmserve vs transformers static batching, in-process")
    add_engine_args(o)
    o.add_argument("--num-prompts", type=int, default=64)
    o.add_argument("--input-min", type=int, default=32)
    o.add_argument("--input-max", type=int, default=256)
    o.add_argument("--output-min", type=int, default=16)
    o.add_argument("--output-max", type=int, default=128)
    o.add_argument("--output-dist", choices=["uniform", "exponential"], default="uniform")
    o.add_argument("--output-mean", type=float, default=64.0,
                   help="mean output length for --output-dist exponential")
    o.add_argument("--seed", type=int, default=0)
    o.add_argument("--skip-baseline", action="store_true")
    o.add_argument("--json", default=None, help="write the figures to this JSON file")
    o.add_argument("--eval-json", default=None,
                   help="an `llmserve eval --json` report: attach this configuration's "
                        "quality-gate row to the figures")
    o.set_defaults(func=lambda a: cmd_offline(a, make_config))

    p = bsub.add_parser("prefix", help="shared-prefix workload, prefix cache on vs off")
    add_engine_args(p)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--prefix-len", type=int, default=1000)
    p.add_argument("--suffix-len", type=int, default=24)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    p.set_defaults(func=lambda a: cmd_prefix(a, make_config))


