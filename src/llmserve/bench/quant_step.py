"""``llmserve bench quant``: decode-step time of the same model under several
``--quantization`` values, side by side in one process.

One engine per value is built with otherwise identical flags; for each batch size every
engine gets the same prompts, prefills them and warms up, then the timed decode steps are
interleaved (one step of each engine in turn), so background load on a shared machine hits
all of them alike. Reported per engine: median and 10th-percentile step time, tokens/s at
the median, and the weight bytes resident.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Callable, Optional


def _fill(engine, tag: str, batch: int, prompt_len: int, max_tokens: int,
          loras: Optional[list[Optional[str]]] = None) -> None:
    """Start ``batch`` greedy requests (round-robin over ``loras`` adapter names when
    given) and run until all of them decode."""
    from llmserve.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for i in range(batch):
        prompt = [1000 + (i * 7 + j) % 20000 for j in range(prompt_len)]
        engine.add_request(f"{tag}-{i}", prompt, params,
                           lora=loras[i % len(loras)] if loras else None)
    while any(r.num_computed_tokens < r.num_prompt_tokens
              for r in engine.scheduler.requests.values()):
        engine.step()
    for _ in range(3):
        engine.step()


def step_stats(ms: list[float]) -> tuple[float, float]:
    """Median and 10th percentile of step times (``ms`` is sorted in place)."""
    ms.sort()
    return statistics.median(ms), ms[len(ms) // 10]


def time_steps(engines: dict, batch: int, prompt_len: int, steps: int,
               loras: Optional[dict] = None) -> dict[str, list[float]]:
    """Milliseconds of ``steps`` interleaved decode steps per engine at ``batch`` sequences
    (``loras``: engine name -> the adapter names its requests take in turn)."""
    for name, engine in engines.items():
        _fill(engine, f"bq-{batch}-{name}", batch, prompt_len, steps + 8,
              (loras or {}).get(name))
    times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(steps):
        for name, engine in engines.items():
            t = time.perf_counter()
            engine.step()
            times[name].append((time.perf_counter() - t) * 1000)
    for engine in engines.values():
        for rid in list(engine._requests):
            engine.abort_request(rid)
    return times


def cmd_quant(args: argparse.Namespace, make_config: Callable) -> int:
    from llmserve.llm_engine import LLMEngine

    base = make_config(args)
    engines = {}
    for q in args.quantizations.split(","):
        engines[q] = LLMEngine(base.replace(quantization=q.strip()))
    batches = [int(b) for b in args.batch_sizes.split(",")]
    rows = []
    for b in batches:
        times = time_steps(engines, b, args.prompt_len, args.steps)
        for name, ms in times.items():
            med, p10 = step_stats(ms)
            rows.append({"batch": b, "quantization": name,
                         "runtime": engines[name].runner.quantization,
                         "weight_bytes": engines[name].runner.weight_bytes,
                         "median_ms": med, "p10_ms": p10,
                         "tok_per_s": b / med * 1000})
    first = next(iter(engines.values()))
    mode = "compiled" if first.runner.compiled is not None else "eager"
    print(f"model {first.model_name}  dtype {first.dtype}  kv {first.kv_dtype}  {mode}  "
          f"steps {args.steps} interleaved")
    print(f"{'batch':>5} {'quantization':<12} {'weights MB':>10} {'median ms':>10} "
          f"{'p10 ms':>8} {'tok/s':>8}  runtime")
    for r in rows:
        print(f"{r['batch']:5d} {r['quantization']:<12} {r['weight_bytes'] / 1e6:10.1f} "
              f"{r['median_ms']:10.2f} {r['p10_ms']:8.2f} {r['tok_per_s']:8.1f}  {r['runtime']}")
    if args.eval_json:
        from llmserve.eval.report import format_gate, gate_for

        for name, engine in engines.items():
            gate = gate_for(args.eval_json, engine.runner.quantization, engine.kv_dtype)
            print(f"{name:<12} {format_gate(gate)}")
            for r in rows:
                if r["quantization"] == name:
                    r["quality_gate"] = gate
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"model": first.model_name, "dtype": first.dtype, "mode": mode,
                       "rows": rows}, f, indent=2)
    return 0


def add_quant_bench_parser(bsub, add_engine_args: Callable, make_config: Callable) -> None:
    """Register ``bench quant`` under the ``bench`` sub-parser."""
    p = bsub.add_parser("quant", help="decode-step time under several --quantization values, "
                                      "side by side in one process")
    add_engine_args(p)
    p.add_argument("--quantizations", default="none,auto",
                   help="comma list of --quantization values to compare")
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--json", default=None, help="write the figures to this JSON file")
    p.add_argument("--eval-json", default=None,
                   help="an `llmserve eval --json` report: print each engine's gate result")
    p.set_defaults(func=lambda a: cmd_quant(a, make_config))
