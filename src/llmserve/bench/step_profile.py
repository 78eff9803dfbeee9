"""``llmserve bench step``: where the time of one engine step goes, against its roofline.

For each batch size it fills the engine with that many sequences (prompt prefilled, then
decoding with ignore_eos), times ``--steps`` decode steps and splits each into::

    schedule   Scheduler.schedule()
    prep       StepInput from the scheduler + the runner's staging of index tensors
    forward    the model (compiled graph or eager forward, logits included when compiled)
    sample     the batched sampler (and the LM head on eager steps)
    output     appending tokens, stop checks, detokenization
    other      the rest of LLMEngine.step (deadlines, folding outputs)

It also measures the machine's read bandwidth (a streaming reduction over a buffer larger
than the caches) and prints the batch-1 roofline: resident weight bytes / bandwidth, the
time a decode step needs just to read the weights once. ``--trace DIR`` writes a
torch.profiler trace of the timed steps (open it in Perfetto or chrome://tracing).
"""
from __future__ import annotations

import argparse
import json
import logging
import time
from collections import defaultdict
from typing import Callable, Optional

logger = logging.getLogger(__name__)

PHASES = ("schedule", "prep", "forward", "sample", "output", "other")


def measure_read_bandwidth(nbytes: int = 1 << 29, repeats: int = 5) -> float:
    """Bytes per second of a streaming read (sum over an int8 buffer viewed as float32)."""
    import torch

    buf = torch.ones(nbytes // 4, dtype=torch.float32)
    buf.sum()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t)
    return nbytes / best


class _Timers:
    """Accumulates wall time per phase by wrapping callables."""

    def __init__(self) -> None:
        self.total: dict[str, float] = defaultdict(float)
        self.enabled = False

    def wrap(self, phase: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            if not self.enabled:
                return fn(*args, **kwargs)
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total[phase] += time.perf_counter() - t
        return timed


class _TimedCompiled:
    """Times calls of the compiled step without touching it (its guards check its type)."""

    def __init__(self, inner, timers: _Timers) -> None:
        self._inner = inner
        self._call = timers.wrap("forward", inner.__call__)

    def __call__(self, staged):
        return self._call(staged)

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


def _instrument(engine, timers: _Timers) -> None:
    import llmserve.engine.core as core_mod

    runner = engine.runner
    core = engine.core
    core.scheduler.schedule = timers.wrap("schedule", core.scheduler.schedule)
    core_mod.build_step_input = timers.wrap("prep", core_mod.build_step_input)
    runner.buffers.stage = timers.wrap("prep", runner.buffers.stage)
    if runner.compiled is None:   # the compiled graph calls the model itself: time it whole
        runner.model.forward = timers.wrap("forward", runner.model.forward)
    else:
        runner.compiled = _TimedCompiled(runner.compiled, timers)
    runner._sample = timers.wrap("sample", runner._sample)
    core._append_tokens = timers.wrap("output", core._append_tokens)


def profile_batch(engine, batch: int, prompt_len: int, steps: int,
                  trace_dir: Optional[str] = None) -> dict:
    """Time ``steps`` decode steps of ``batch`` sequences; per-phase milliseconds per step."""
    from llmserve.sampling_params import SamplingParams

    timers = engine._bench_timers
    params = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
    for i in range(batch):
        prompt = [1000 + (i * 7 + j) % 20000 for j in range(prompt_len)]
        engine.add_request(f"bench-step-{batch}-{i}", prompt, params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()):
        engine.step()
    for _ in range(3):
        engine.step()                     # warm: first decode steps, compiled buckets
    timers.total.clear()
    timers.enabled = True
    prof = None
    if trace_dir:
        import torch.profiler as tp

        prof = tp.profile(activities=[tp.ProfilerActivity.CPU])
        prof.__enter__()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall = time.perf_counter() - t0
    timers.enabled = False
    if prof is not None:
        prof.__exit__(None, None, None)
        path = f"{trace_dir}/step_trace_b{batch}.json"
        prof.export_chrome_trace(path)
        logger.info("wrote %s", path)
    for rid in list(engine._requests):
        engine.abort_request(rid)
    ms = {k: v / steps * 1000 for k, v in timers.total.items()}
    ms["other"] = max(0.0, wall / steps * 1000 - sum(ms.get(p, 0.0) for p in PHASES[:-1]))
    ms["step"] = wall / steps * 1000
    return ms


def cmd_step(args: argparse.Namespace, make_config: Callable) -> int:
    from llmserve.llm_engine import LLMEngine

    config = make_config(args)
    engine = LLMEngine(config)
    engine._bench_timers = _Timers()
    _instrument(engine, engine._bench_timers)
    runner = engine.runner
    bw = measure_read_bandwidth()
    weight_bytes = runner.weight_bytes
    roofline_ms = weight_bytes / bw * 1000
    batches = [int(b) for b in args.batch_sizes.split(",")]
    rows = {}
    for b in batches:
        if b > config.scheduler.max_num_seqs:
            raise SystemExit(f"batch {b} exceeds --max-num-seqs {config.scheduler.max_num_seqs}")
        rows[b] = profile_batch(engine, b, args.prompt_len, args.steps, args.trace)
    mode = "compiled" if runner.compiled is not None and not runner.compiled.failed else "eager"
    print(f"model {engine.model_name}  dtype {engine.dtype}  kv {engine.kv_dtype}  {mode}  "
          f"attention {runner.backend.name}  weights {runner.quantization}")
    print(f"weights resident {weight_bytes / 1e6:.1f} MB   read bandwidth {bw / 1e9:.1f} GB/s   "
          f"batch-1 roofline {roofline_ms:.2f} ms")
    head = "batch " + "".join(f"{p:>10s}" for p in PHASES) + f"{'step ms':>10s}{'tok/s':>9s}"
    print(head)
    for b, ms in rows.items():
        cells = "".join(f"{ms.get(p, 0.0):10.2f}" for p in PHASES)
        print(f"{b:5d} {cells}{ms['step']:10.2f}{b / ms['step'] * 1000:9.1f}")
    if 1 in rows:
        print(f"batch-1 step / roofline = {rows[1]['step'] / roofline_ms:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": engine.model_name, "dtype": engine.dtype, "mode": mode,
                       "weight_bytes": weight_bytes, "read_bandwidth": bw,
                       "roofline_ms": roofline_ms, "steps": {str(b): v for b, v in rows.items()}},
                      f, indent=2)
    return 0


def add_step_bench_parser(bsub, add_engine_args: Callable, make_config: Callable) -> None:
    """Register `bench step` under the `bench` sub-parser."""
    p = bsub.add_parser("step", help="split of one decode step (schedule/prep/forward/sample/"
                                     "output) at several batch sizes, vs the roofline")
    add_engine_args(p)
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--trace", default=None, help="directory for torch.profiler traces")
    p.add_argument("--json", default=None, help="write the figures to this JSON file")
    p.set_defaults(func=lambda a: cmd_step(a, make_config))
