"""Weights and KV on 4 KB pages against 2 MB huge pages, alternated in one process.

    python scripts/bench_huge_pages.py [--rows 1,32] [--rounds 9] [--context 176]

Two measurements, each copying the same bytes into two arenas (one advised MADV_NOHUGEPAGE,
one MADV_HUGEPAGE before its first write) and timing them in alternation:

- the default model's int4 products (its 120 packed q/k/v, o, gate/up and down weights, as
  the loaded engine holds them) at each ``--rows`` count: the weights stream from memory;
- ``paged_decode`` (the native decode attention) over 30 layers' K/V in turn (cold caches),
  32 rows of ``--context`` keys in shuffled 16-key blocks.

Prints the least and median time of each and the ratio. See docs/BENCHMARKS.md, "Huge pages".
"""
from __future__ import annotations

import argparse
import ctypes
import os
import random
import statistics
import time
from typing import Callable

import torch

MB2 = 2 << 20
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def arena(tensors: "list[torch.Tensor]", huge: bool) -> "tuple[torch.Tensor, list[torch.Tensor]]":
    """Copies of ``tensors`` packed into one buffer on huge pages or on 4 KB pages."""
    total = sum(t.nbytes + 64 for t in tensors) + 2 * MB2
    buf = torch.empty(total, dtype=torch.uint8)
    start = (buf.data_ptr() + MB2 - 1) // MB2 * MB2
    end = (buf.data_ptr() + total) // MB2 * MB2
    _libc.madvise(start, end - start, 14 if huge else 15)   # MADV_(NO)HUGEPAGE
    off = start - buf.data_ptr()
    out = []
    for t in tensors:
        view = buf[off:off + t.nbytes].view(t.dtype).view(t.shape)
        view.copy_(t)
        out.append(view)
        off += (t.nbytes + 63) // 64 * 64
    return buf, out


def alternate(fns: "dict[str, Callable[[], None]]", rounds: int) -> "dict[str, list[float]]":
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            fn()
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return times


def report(label: str, times: "dict[str, list[float]]", unit: float = 1e3) -> None:
    small, huge = (times["4 KB"], times["2 MB"])
    print(f"{label}: 4 KB pages {min(small) * unit:.2f} (median {statistics.median(small) * unit:.2f}), "
          f"2 MB pages {min(huge) * unit:.2f} (median {statistics.median(huge) * unit:.2f}); "
          f"2 MB is {min(small) / min(huge):.2f}x faster", flush=True)


def products(rows_list: "list[int]", rounds: int) -> None:
    from llmserve.llm import LLM
    from llmserve.model.quant.kernels import Int4Weight
    from llmserve.model.quant.native_int4 import int4_a8_mm, int4_mm

    os.environ["LLMSERVE_HUGE_PAGES"] = "0"     # the engine's own copy stays on 4 KB pages
    llm = LLM(max_num_seqs=8)
    mods = [m for m in llm.engine.runner.model.modules() if isinstance(m, Int4Weight)]
    sets = {}
    for name, huge in (("4 KB", False), ("2 MB", True)):
        buf, views = arena([t for m in mods for t in (m.qweight, m.scales_zeros)], huge)
        sets[name] = (buf, [(m, views[2 * i], views[2 * i + 1]) for i, m in enumerate(mods)])
    for rows in rows_list:
        xs = {m.in_features: torch.randn(rows, m.in_features).bfloat16() for m in mods}

        def run(weights: list) -> None:
            for m, q, sz in weights:
                (int4_a8_mm if m.int8_activations else int4_mm)(xs[m.in_features], q, sz,
                                                                m.group_size)
        times = alternate({k: (lambda w=w: run(w)) for k, (_, w) in sets.items()}, rounds)
        report(f"{len(mods)} int4 products, {rows} rows (ms)", times)


def attention(context: int, rounds: int, rows: int = 32, layers: int = 30) -> None:
    from llmserve.model.native.ops import native_available
    if not native_available():
        print("paged_decode: the native kernels are not available here")
        return
    heads, kv_heads, dim = 9, 3, 64
    rng = random.Random(0)
    per_row = -(-context // 16)
    blocks = rows * per_row * 4
    order = list(range(blocks))
    rng.shuffle(order)
    slots = torch.tensor([[order[i * per_row + l // 16] * 16 + l % 16 for l in range(context)]
                          for i in range(rows)], dtype=torch.int64)
    valid = torch.ones(rows, context, dtype=torch.bool)
    q = torch.randn(rows, heads, dim).bfloat16()
    kv = torch.randn(layers, 2, blocks * 16, kv_heads, dim).bfloat16()
    pools = {name: arena([kv], huge)[1][0] for name, huge in (("4 KB", False), ("2 MB", True))}
    op = torch.ops.llmserve_native.paged_decode

    def run(pool: torch.Tensor) -> None:
        for j in range(layers):
            op(q, pool[j, 0], pool[j, 1], slots, valid, 0.125, 0.0)
    times = alternate({k: (lambda p=p: run(p)) for k, p in pools.items()}, rounds)
    report(f"paged_decode, {rows} rows x {context} keys, {layers} layers in turn (ms)", times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,32")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--context", type=int, default=176)
    args = p.parse_args()
    products([int(r) for r in args.rows.split(",")], args.rounds)
    attention(args.context, args.rounds)


if __name__ == "__main__":
    main()
