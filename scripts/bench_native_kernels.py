"""Time llmserve's native CPU kernels at the default model's shapes (one op at a time).

    python scripts/bench_native_kernels.py [--json FILE] [--repeats N]

Prints one line per case: the op, its shape, the time per call (the first quartile of
``--repeats`` calls after a warm-up; the cold attention cases: the median over 30 layers'
caches read in turn) and, for the products, GFLOP/s; the float32 dense product runs beside
PyTorch's ``F.linear`` (``torch-linear``), and under ``LLMSERVE_CPU_ISA=avx2`` it is the only
case (the avx2 library's build). Side-by-side figures
for a change come from running this under the tree before and after it, alternated
(``PYTHONPATH=<old tree>/src python scripts/bench_native_kernels.py``; the kernel cache is
keyed by the sources, so both trees keep their own build). Exits 2 where no kernel library
loads (no AVX2 or no compiler).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Callable

import torch

# SmolLM2-135M: hidden 576, 9 heads / 3 KV heads of 64, MLP 1536, vocab 49152, groups of 32
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MLP, VOCAB, GROUP = 576, 9, 3, 64, 1536, 49152, 32
LINEARS = {"qkv": (HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM), "o": (HIDDEN, HIDDEN),
           "gate_up": (HIDDEN, 2 * MLP), "down": (MLP, HIDDEN)}


def time_call(fn: Callable[[], object], repeats: int) -> float:
    """Seconds per call: the first quartile of ``repeats`` timed calls after 5 warm-ups."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 4]


def int4_ops() -> list[tuple[str, Callable, Callable]]:
    """``(op, pack(q, scale, zero) -> weight, product(x, *weight))`` of each int4 kernel
    this machine runs: bf16 activations, and int8 ones where the CPU has AVX512-VNNI."""
    from llmserve.model.quant import native_int4 as n4
    ops = [("int4_mm", lambda q, s, z: n4.pack_int4(q, s, z, GROUP),
            lambda x, p, sz: torch.ops.llmserve_native.int4_mm(x, p, sz, GROUP))]
    if n4.native_int4_a8_available():
        ops.append(("int4_a8_mm", lambda q, s, z: n4.pack_int4_a8(q, s, z, GROUP),
                    lambda x, p, sm: torch.ops.llmserve_native.int4_a8_mm(x, p, sm, GROUP)))
    return ops


def random_int4(k: int, n: int, pack: Callable) -> tuple[torch.Tensor, torch.Tensor]:
    """A random ``(n, k)`` int4 weight packed by ``pack`` (one of :func:`int4_ops`)."""
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    return pack(q, torch.rand(n, k // GROUP) * 0.01 + 0.005, torch.randn(n, k // GROUP) * 0.01)


def int4_cases(repeats: int) -> list[dict]:
    rows_out = []
    for op, pack, product in int4_ops():
        for rows in (1, 8, 24, 128, 1024, 2048):
            total = 0.0
            for name, (k, n) in LINEARS.items():
                weight = random_int4(k, n, pack)
                x = torch.randn(rows, k).bfloat16()
                s = time_call(lambda: product(x, *weight), repeats)
                total += s
                rows_out.append({"op": op, "case": f"{name} {k}x{n}", "rows": rows,
                                 "us": s * 1e6, "gflops": 2 * rows * k * n / s / 1e9})
            rows_out.append({"op": op, "case": "one layer (4 products)", "rows": rows,
                             "us": total * 1e6})
    return rows_out


def int4_step_cases(repeats: int) -> list[dict]:
    """A decode step's 120 products with 30 layers' distinct weights (69 MB): each call
    streams its weights from memory, as in the model, instead of finding them cached."""
    out = []
    for op, pack, product in int4_ops():
        weights = [(k, random_int4(k, n, pack)) for _ in range(30) for k, n in LINEARS.values()]
        for rows in (1, 8, 24):
            xs = {k: torch.randn(rows, k).bfloat16() for k in (HIDDEN, MLP)}

            def step() -> None:
                for k, weight in weights:
                    product(xs[k], *weight)
            s = time_call(step, max(3, repeats // 4))
            flops = 2 * rows * 30 * sum(k * n for k, n in LINEARS.values())
            out.append({"op": op, "case": "a step's 120 products, streamed", "rows": rows,
                        "us": s * 1e6, "gflops": flops / s / 1e9})
    return out


def head_cases(repeats: int) -> list[dict]:
    """The tied int8 LM head: bf16 activations (int8_mm) and, where the CPU has
    AVX512-VNNI, int8 activations (int8_a8_mm)."""
    from llmserve.model.quant.native_int8 import native_int8_a8_available, pack_int8, pack_int8_a8
    q = torch.randint(-127, 128, (VOCAB, HIDDEN), dtype=torch.int8)
    scale = torch.rand(VOCAB).bfloat16()
    ops = [("int8_mm", pack_int8(q))]
    if native_int8_a8_available():
        ops.append(("int8_a8_mm", pack_int8_a8(q)))
    out = []
    for name, packed in ops:
        op = getattr(torch.ops.llmserve_native, name)
        for rows in (1, 8, 24, 32):
            x = torch.randn(rows, HIDDEN).bfloat16()
            s = time_call(lambda: op(x, packed, scale, True), repeats)
            out.append({"op": name, "case": f"LM head {HIDDEN}x{VOCAB}", "rows": rows,
                        "us": s * 1e6, "gflops": 2 * rows * HIDDEN * VOCAB / s / 1e9})
    return out


def bf16_head_cases(repeats: int) -> list[dict]:
    """A dense bf16 LM head (bf16_mm, float32 logits): the row tiles (up to 8 rows) and the
    many-row panels, whose summation order is the row tiles' (batch invariance)."""
    from llmserve.model.layers.native_dense import pack_bf16
    packed = pack_bf16(torch.randn(VOCAB, HIDDEN).bfloat16())
    out = []
    for rows in (1, 4, 8, 16, 32, 64, 256):
        x = torch.randn(rows, HIDDEN).bfloat16()
        s = time_call(lambda: torch.ops.llmserve_native.bf16_mm(x, packed, True),
                      repeats if rows <= 64 else max(3, repeats // 4))
        out.append({"op": "bf16_mm", "case": f"LM head {HIDDEN}x{VOCAB}", "rows": rows,
                    "us": s * 1e6, "gflops": 2 * rows * HIDDEN * VOCAB / s / 1e9})
    return out


def f32_cases(repeats: int) -> list[dict]:
    """Dense float32 linears: the tier library's f32_mm (one summation order at every row
    count) beside PyTorch's ``F.linear`` (op ``torch-linear``) on the same weights."""
    import torch.nn.functional as F

    from llmserve.model.layers.native_dense import f32_mm, native_f32_available, pack_f32
    if not native_f32_available():
        return []
    out = []
    for name, (k, n) in LINEARS.items():
        w = torch.randn(n, k)
        packed = pack_f32(w)
        for rows in (1, 8, 32, 128, 512):
            x = torch.randn(rows, k)
            reps = repeats if rows <= 32 else max(3, repeats // 4)
            for op, fn in (("f32_mm", lambda: f32_mm(x, packed, n)),
                           ("torch-linear", lambda: F.linear(x, w))):
                s = time_call(fn, reps)
                out.append({"op": op, "case": f"{name} {k}x{n} float32", "rows": rows,
                            "us": s * 1e6, "gflops": 2 * rows * k * n / s / 1e9})
    return out


def attention_cases(repeats: int) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    slots_total = 65536
    kc = torch.randn(slots_total, KV_HEADS, HEAD_DIM, generator=gen).bfloat16()
    vc = torch.randn(slots_total, KV_HEADS, HEAD_DIM, generator=gen).bfloat16()
    out = []

    def run(case: str, b: int, slots: torch.Tensor, valid: torch.Tensor) -> None:
        q = torch.randn(b, HEADS, HEAD_DIM, generator=gen).bfloat16()
        s = time_call(lambda: torch.ops.llmserve_native.paged_decode(q, kc, vc, slots, valid,
                                                                     0.125, 0.0), repeats)
        out.append({"op": "paged_decode", "case": case, "rows": b, "us": s * 1e6})

    for b, length in ((1, 192), (8, 192), (24, 192), (24, 1024)):
        blocks = torch.randperm(slots_total // 16, generator=gen)[:b * (length // 16)].view(b, -1)
        slots = (blocks.unsqueeze(-1) * 16 + torch.arange(16)).view(b, -1).contiguous()
        run(f"decode, {length} keys each", b, slots, torch.ones(b, length, dtype=torch.bool))
    # a prefill chunk of 8 prompts x 128 tokens: one row per token, its causal keys
    blocks = torch.randperm(slots_total // 16, generator=gen)[:64].view(8, 8)
    per_prompt = (blocks.unsqueeze(-1) * 16 + torch.arange(16)).view(8, 128)
    slots = per_prompt.repeat_interleave(128, 0).contiguous()
    valid = (torch.arange(128).unsqueeze(0) <= (torch.arange(1024) % 128).unsqueeze(1))
    run("prefill rows, 8 x 128 causal", 1024, slots, valid.contiguous())
    return out


def cold_attention_cases(repeats: int) -> list[dict]:
    """Decode attention as a step meets it: 30 layers' caches read in turn, so that every
    call finds its K and V rows in memory, not in cache (the cases above repeat one call on
    data it has just read). 8 / 32 / 64 sequences of 150-170 keys, each in 11 adjacent
    blocks; the caches are numpy-allocated as the engine's pool is (huge pages)."""
    import numpy as np
    layers, blocks_total = 30, 1024
    shape = (blocks_total * 16, KV_HEADS, HEAD_DIM)
    nbytes = int(np.prod(shape)) * 2
    caches = [tuple(torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(torch.bfloat16)
                    .view(shape).normal_() for _ in range(2)) for _ in range(layers)]
    gen = torch.Generator().manual_seed(1)
    out = []
    for b in (8, 32, 64):
        length = 176
        slots = (torch.arange(b * 11).view(b, 11).unsqueeze(-1) * 16 + torch.arange(16))
        slots = slots.view(b, -1)[:, :length].contiguous()
        ctx = torch.randint(150, 171, (b, 1), generator=gen)
        valid = (torch.arange(length).unsqueeze(0) < ctx).contiguous()
        q = torch.randn(b, HEADS, HEAD_DIM, generator=gen).bfloat16()
        times = []
        for rep in range(max(2, repeats // layers + 1)):
            for kc, vc in caches:
                t0 = time.perf_counter()
                torch.ops.llmserve_native.paged_decode(q, kc, vc, slots, valid, 0.125, 0.0)
                if rep:
                    times.append(time.perf_counter() - t0)
        times.sort()
        out.append({"op": "paged_decode", "case": "decode, cold, 150-170 keys", "rows": b,
                    "us": times[len(times) // 2] * 1e6})
    return out


def main(argv: "list[str] | None" = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="write the rows to this JSON file")
    p.add_argument("--repeats", type=int, default=40)
    args = p.parse_args(argv)
    from llmserve.model.native.ops import cpu_tier, native_available, tier_ops
    if tier_ops() is None:
        print("native kernels unavailable here (AVX2 or AVX512-BF16, and a C++ compiler)",
              file=sys.stderr)
        return 2
    rows = f32_cases(args.repeats)   # every tier's library has f32_mm
    if native_available() and cpu_tier() != "avx2":
        rows += (int4_cases(args.repeats) + int4_step_cases(args.repeats)
                 + head_cases(args.repeats) + bf16_head_cases(args.repeats)
                 + attention_cases(args.repeats) + cold_attention_cases(args.repeats))
    print(f"torch threads: {torch.get_num_threads()}")
    for r in rows:
        flops = f"  {r['gflops']:6.0f} GFLOP/s" if "gflops" in r else ""
        print(f"{r['op']:13s} {r['case']:30s} rows {r['rows']:5d}  {r['us']:9.1f} us{flops}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": torch.get_num_threads(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
