"""Time a GGUF Q4_K_M file's products in their two layouts, one op at a time.

    python scripts/bench_gguf_blocks.py [--weights 6] [--rows 1,16,128]

Prints, per Llama-3.2-1B shape and row count, the time per call of a Q4_K weight as int4
groups of 32 (``int4_a8_mm``, the layout without the block kernel) and as the file's own
blocks (``qblock_a8_mm``'s 4-bit k32 mode), with their resident bytes; then the tied Q6_K
head (128256 x 2048) as blocks against int8 rows, and the embedding lookup of each. The
weights are random valid blocks; ``--weights`` different ones are used in turn so they come
from memory, as in a decode step. Exits 2 where the block kernel is unavailable.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from gguf import GGMLQuantizationType as Q

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmserve.model.quant.block_codes import to_block_codes  # noqa: E402
from llmserve.model.quant.gguf_blocks import to_int4_groups  # noqa: E402
from llmserve.model.quant.kernels import Int4Weight, Int8Weight, quantize_int8  # noqa: E402
from llmserve.model.quant.native_qblock import (  # noqa: E402
    QBlockTable,
    QBlockWeight,
    native_qblock_available,
)
from tests.model.quant_helpers import gguf_blocks  # noqa: E402

#: Llama-3.2-1B: gate/up fused, down, q/k/v fused
SHAPES = [(16384, 2048), (2048, 8192), (3072, 2048)]
VOCAB, HIDDEN = 128256, 2048


def per_call(fns: "list[Callable[[], object]]", passes: int) -> float:
    """Microseconds per call, each of ``fns`` called in turn ``passes`` times after a warm-up."""
    for fn in fns:
        fn()
    start = time.perf_counter()
    for _ in range(passes):
        for fn in fns:
            fn()
    return (time.perf_counter() - start) / passes / len(fns) * 1e6


def main(argv: "list[str] | None" = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--weights", type=int, default=6)
    p.add_argument("--rows", default="1,16,128")
    args = p.parse_args(argv)
    if not native_qblock_available():
        print("the block kernel is unavailable here (AVX512-VNNI and a compiler needed)")
        return 2
    rows_list = [int(r) for r in args.rows.split(",")]
    for n, k in SHAPES:
        raws = [gguf_blocks(Q.Q4_K, n, k, seed=i) for i in range(args.weights)]
        blocks = [QBlockWeight(to_block_codes(r, q4_k=True)) for r in raws]
        groups = [Int4Weight(to_int4_groups(r), int8_activations=True) for r in raws]
        for rows in rows_list:
            x = torch.randn(rows, k).bfloat16()
            passes = max(3, 60 // rows)
            t_int4 = per_call([lambda w=w: w(x) for w in groups], passes)
            t_blocks = per_call([lambda w=w: w(x) for w in blocks], passes)
            print(f"Q4_K {n}x{k} rows={rows}: int4 g32 {t_int4:.0f} us "
                  f"({groups[0].nbytes / 1e6:.2f} MB), blocks {t_blocks:.0f} us "
                  f"({blocks[0].nbytes / 1e6:.2f} MB)")
    raw = gguf_blocks(Q.Q6_K, VOCAB, HIDDEN, seed=1, super_scale=2e-5)
    table = QBlockTable(to_block_codes(raw))
    int8_rows = Int8Weight(*quantize_int8(table.rows(torch.arange(VOCAB), torch.float32)),
                           int8_activations=True)
    print(f"Q6_K table {VOCAB}x{HIDDEN}: blocks {table.nbytes / 1e6:.1f} MB, "
          f"int8 rows {int8_rows.nbytes / 1e6:.1f} MB")
    for rows in rows_list[:2]:
        x = torch.randn(rows, HIDDEN).bfloat16()
        for name, head in (("int8 rows", int8_rows), ("blocks", table)):
            ms = per_call([lambda h=head: h.logits(x)], 10) / 1e3
            print(f"  head rows={rows}: {name} {ms:.2f} ms")
    for count in (1, 512):
        ids = torch.randint(0, VOCAB, (count,))
        for name, head in (("int8 rows", int8_rows), ("blocks", table)):
            us = per_call([lambda h=head: h.rows(ids, torch.bfloat16)], 10)
            print(f"  lookup of {count} rows: {name} {us:.0f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
