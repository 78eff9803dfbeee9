"""TPOT of one stream through AsyncLLM with the engine built on the main thread (``main``)
or on the engine thread (``thread``, what ``AsyncLLM.from_config`` does).

    python scripts/bench_engine_thread.py main; python scripts/bench_engine_thread.py thread

Prints the median inter-token gap of 5 streams of 64 tokens (default model, default flags).
See docs/BENCHMARKS.md, "One thread owns the OpenMP pools".
"""
import asyncio
import statistics
import sys
import time

from llmserve.async_llm import AsyncLLM
from llmserve.config import EngineConfig
from llmserve.llm_engine import LLMEngine
from llmserve.sampling_params import SamplingParams


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "thread"
    if mode not in ("main", "thread"):
        raise SystemExit("usage: bench_engine_thread.py main|thread")
    cfg = EngineConfig.from_kwargs(model=None, max_num_seqs=8, max_model_len=2048)
    llm = AsyncLLM(LLMEngine(cfg)) if mode == "main" else AsyncLLM.from_config(cfg)
    prompt = "Write a long story about a dragon who learns to code. " * 4
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)

    async def one(i: int) -> float:
        stamps = []
        async for _ in llm.generate(prompt, params, f"s{i}"):
            stamps.append(time.perf_counter())
        gaps = [b - a for a, b in zip(stamps, stamps[1:])]
        return statistics.median(gaps[2:]) * 1e3

    try:
        res = [round(asyncio.run(one(i)), 2) for i in range(5)]
    finally:
        llm.shutdown()
    print(f"engine built on the {mode} thread: AsyncLLM TPOT p50 ms per stream: {res}")


if __name__ == "__main__":
    main()
