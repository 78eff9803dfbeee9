"""Where one burst of requests spends its time in the engine (no HTTP, no client).

    python scripts/step_timeline.py [--num-prompts 24] [--input-len 128] [--output-len 64]
                                    [--repeats 2] [engine flags as `key=value` ...]

Sends ``--num-prompts`` random prompts at once (the `bench compare` workload at
concurrency >= num-prompts), steps the engine until all finish and prints, per repeat: the
wall time, output tokens/s, the first steps' durations (the prefill chunks under the step's
token budget) and the decode steps' sum and median. A warm-up burst runs first. Extra
arguments are engine flags, e.g. ``quantization=none`` or ``max_num_batched_tokens=4096``.
"""
from __future__ import annotations

import argparse
import random
import time

from llmserve.llm import LLM
from llmserve.sampling_params import SamplingParams


def _value(text: str) -> object:
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def main(argv: "list[str] | None" = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-prompts", type=int, default=24)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("engine_args", nargs="*", help="engine flags as key=value")
    args = p.parse_args(argv)
    bad = [a for a in args.engine_args if "=" not in a]
    if bad:
        p.error(f"engine flags go as key=value, got {' '.join(bad)}")
    if args.output_len < 2 or args.num_prompts < 1 or args.input_len < 1:
        p.error("--output-len must be >= 2 (one decode step at least), --num-prompts and "
                "--input-len >= 1")
    kwargs = dict(a.split("=", 1) for a in args.engine_args)
    llm = LLM(**{k: _value(v) for k, v in kwargs.items()})
    engine = llm.engine
    rng = random.Random(0)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)

    def prompts() -> list[list[int]]:
        return [[rng.randrange(100, 40000) for _ in range(args.input_len)]
                for _ in range(args.num_prompts)]

    llm.generate(prompts(), params)  # warm-up: compiled graphs, first touch of the pool
    for rep in range(args.repeats):
        for i, prompt in enumerate(prompts()):
            engine.add_request(f"burst{rep}-{i}", prompt, params)
        steps: list[float] = []
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            t = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t)
        wall = time.perf_counter() - t0
        budget = engine.config.scheduler.max_num_batched_tokens
        prompt_steps = -(-args.num_prompts * args.input_len // budget)
        decode = sorted(steps[prompt_steps:]) or [0.0]
        tokens = args.num_prompts * args.output_len
        print(f"repeat {rep}: {wall:.2f} s, {tokens / wall:.1f} output tok/s, {len(steps)} "
              f"steps; prompt steps (budget {budget} tokens) "
              f"{', '.join(f'{s:.3f}' for s in steps[:prompt_steps])} s; decode steps "
              f"{sum(decode):.2f} s, median {decode[len(decode) // 2] * 1e3:.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
