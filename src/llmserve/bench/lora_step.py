"""``llmserve bench lora``: decode-step time with LoRA off, on without adapters in the
batch, one adapter for the whole batch, and several adapters mixed -- side by side.

Random PEFT adapters (``--num-adapters`` of rank ``--rank`` on all seven projections) are
written to a temporary folder for the model under test. Four engines are built with
otherwise identical flags; for each batch size every engine prefills the same prompts,
then the timed decode steps are interleaved (one step of each engine in turn) so that
background load on a shared machine hits all of them alike. Reported: median and
10th-percentile step time and the ratio to the LoRA-off engine.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
from typing import Callable

from llmserve.bench.quant_step import step_stats, time_steps
from llmserve.lora.registry import CONFIG_FILE, SUPPORTED_TARGETS, WEIGHTS_FILE

VARIANTS = ("off", "on-base", "one-adapter", "mixed")


def write_random_adapter(folder: str, mc, rank: int, seed: int) -> str:
    """A PEFT folder with random A/B for every projection of ``mc`` (a ModelConfig)."""
    import torch
    from safetensors.torch import save_file

    from llmserve.lora.weights import TARGET_SUBPATH

    q, kv = mc.num_attention_heads * mc.head_dim, mc.num_key_value_heads * mc.head_dim
    h, inter = mc.hidden_size, mc.intermediate_size
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
              "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(mc.num_hidden_layers):
        for target, (fan_in, fan_out) in shapes.items():
            key = f"base_model.model.model.layers.{layer}.{TARGET_SUBPATH[target]}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * 0.01
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.01
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, WEIGHTS_FILE))
    with open(os.path.join(folder, CONFIG_FILE), "w", encoding="utf-8") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                   "target_modules": list(SUPPORTED_TARGETS)}, f)
    return folder


def cmd_lora(args: argparse.Namespace, make_config: Callable) -> int:
    from llmserve.llm_engine import LLMEngine

    base = make_config(args).replace(lora_modules=(), max_loras=0)
    engines = {"off": LLMEngine(base)}
    mc = engines["off"].model_config
    folder = tempfile.mkdtemp(prefix="llmserve-bench-lora-")
    modules = tuple((f"bench{i}", write_random_adapter(os.path.join(folder, f"a{i}"), mc,
                                                        args.rank, i))
                    for i in range(args.num_adapters))
    lora_cfg = base.replace(lora_modules=modules, max_loras=args.num_adapters,
                                   max_lora_rank=args.rank)
    for name in VARIANTS[1:]:
        engines[name] = LLMEngine(lora_cfg)
    names = [n for n, _ in modules]
    loras = {"off": [None], "on-base": [None], "one-adapter": names[:1], "mixed": names}
    rows = []
    for b in [int(x) for x in args.batch_sizes.split(",")]:
        times = time_steps(engines, b, args.prompt_len, args.steps, loras)
        stats = {name: step_stats(ms) for name, ms in times.items()}
        off = stats["off"][0]
        for name, (med, p10) in stats.items():
            rows.append({"batch": b, "variant": name, "median_ms": med, "p10_ms": p10,
                         "ratio_to_off": med / off})
    first = engines["off"]
    print(f"model {first.model_name}  dtype {first.dtype}  weights {first.runner.quantization}"
          f"  {args.num_adapters} adapters of rank {args.rank}  steps {args.steps} interleaved")
    print(f"{'batch':>5} {'variant':<12} {'median ms':>10} {'p10 ms':>8} {'x off':>6}")
    for r in rows:
        print(f"{r['batch']:5d} {r['variant']:<12} {r['median_ms']:10.2f} {r['p10_ms']:8.2f} "
              f"{r['ratio_to_off']:6.2f}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"model": first.model_name, "rank": args.rank,
                       "num_adapters": args.num_adapters, "rows": rows}, f, indent=2)
    return 0


def add_lora_bench_parser(bsub, add_engine_args: Callable, make_config: Callable) -> None:
    """Register ``bench lora`` under the ``bench`` sub-parser."""
    p = bsub.add_parser("lora", help="decode-step time with LoRA off / on / one adapter / "
                                     "several adapters mixed, side by side in one process")
    add_engine_args(p)
    p.add_argument("--num-adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--json", default=None, help="write the figures to this JSON file")
    p.set_defaults(func=lambda a: cmd_lora(a, make_config))
