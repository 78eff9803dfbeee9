"""Configurations the quality gate knows, with their thresholds (no torch here).

A preset is a set of engine settings applied to the evaluated model. Thresholds compare it
with the reference (default ``fp32``: the same weights dequantized to float32, fp32 KV):

    max_ppl_increase  relative perplexity rise on the fixed text (0.01 = +1 %)
    min_top1          share of positions whose most likely next token is the reference's
    max_kl            mean KL(reference || configuration) of next-token distributions, nats

Numbers measured for the default model are in docs/QUANTIZATION.md; the thresholds leave
room above them for other machines' kernels, not for regressions.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

TEXT_PATH = os.path.join(os.path.dirname(__file__), "eval_text.txt")
PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Water boils at a temperature of",
    "Once upon a time, in a small village by the sea,",
)


@dataclass(frozen=True)
class Thresholds:
    max_ppl_increase: float = 0.02   # relative: 0.02 = +2 %
    min_top1: float = 0.95
    max_kl: float = 0.05             # nats


@dataclass(frozen=True)
class Preset:
    settings: dict
    thresholds: Thresholds = field(default_factory=Thresholds)


PRESETS: dict[str, Preset] = {
    "fp32": Preset(dict(dtype="float32", quantization="none")),
    "bf16": Preset(dict(dtype="bfloat16", quantization="none"), Thresholds(0.01, 0.95, 0.01)),
    "packed": Preset(dict(dtype="bfloat16", quantization="auto"), Thresholds(0.01, 0.93, 0.01)),
    "packed-a8": Preset(dict(dtype="bfloat16", quantization="auto", int4_activations="int8"),
                        Thresholds(0.01, 0.93, 0.01)),
    "packed-a16": Preset(dict(dtype="bfloat16", quantization="auto", int4_activations="bf16"),
                         Thresholds(0.01, 0.93, 0.01)),
    "int8": Preset(dict(dtype="bfloat16", quantization="int8"), Thresholds(0.01, 0.93, 0.02)),
    "int4": Preset(dict(dtype="bfloat16", quantization="int4", quantization_group_size=32),
                   Thresholds(0.05, 0.85, 0.10)),
    "int4-g64": Preset(dict(dtype="bfloat16", quantization="int4", quantization_group_size=64),
                       Thresholds(0.10, 0.80, 0.20)),
    "kv-int8": Preset(dict(dtype="float32", quantization="none", kv_cache_dtype="int8"),
                      Thresholds(0.01, 0.95, 0.01)),
    "kv-fp8": Preset(dict(dtype="float32", quantization="none", kv_cache_dtype="fp8_e4m3"),
                     Thresholds(0.02, 0.93, 0.02)),
    # the default path (packed weights, bf16 queries) over an int8 cache: its own decode
    # kernel on the AVX-512 tiers (paged_decode_q8)
    "packed-kv-int8": Preset(dict(dtype="bfloat16", quantization="auto", kv_cache_dtype="int8"),
                             Thresholds(0.015, 0.93, 0.015)),
}
#: run when ``--configs`` is not given; ``packed-a8`` is left out since it needs the int8
#: activation kernels (AVX512-VNNI or the avx2 tier) and would stop the run elsewhere
DEFAULT_CONFIGS = ("fp32", "bf16", "packed", "packed-a16", "int8", "int4", "kv-int8", "kv-fp8",
                   "packed-kv-int8")


