"""Which kind of product loses the most quality to int8 activations (issue 34 item 2).

    python scripts/activation_sensitivity.py [--model FILE] [--text FILE ...] [--max-tokens N]
        [--combos qkv_proj,head,qkv_proj+head] [--json FILE]

Scores a text (the eval text by default; several ``--text`` files are joined) with three
engines of the same file: the fp32 dequantized reference, ``--int4-activations int8`` (every
product quantizes its activation rows) and ``--int4-activations bf16``. Then, one kind of
product at a time (``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj``, the tied
``head``) and for each ``--combos`` entry, it moves those products of the int8 engine onto the
bf16 engine's weights and scores again. Each line prints perplexity, top-1 agreement and mean
KL against the reference, as ``llmserve eval`` computes them; the KL a kind removes, set
against the time its bf16 product costs (``scripts/bench_native_kernels.py``), is how
``--int4-activations auto`` picked the products that keep bf16 activations
(docs/QUANTIZATION.md, "Which products take int8 activations"). Needs the int4 x int8 kernel
(AVX512-VNNI); exits 2 without it.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch
from torch import nn


def _kind(name: str) -> str:
    """``layers.3.self_attn.qkv_proj.qweight`` -> ``qkv_proj``; the embedding table -> head."""
    return name.split(".")[-2] if name.startswith("layers.") else "head"


def _swap(root: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, leaf, module)


def main(argv: "list[str] | None" = None) -> int:
    from llmserve.default_model import resolve_model_path
    from llmserve.eval import gate, metrics
    from llmserve.eval.presets import PRESETS, TEXT_PATH
    from llmserve.model.quant.kernels import Int4Weight, Int8Weight
    from llmserve.model.quant.native_int4 import native_int4_a8_available
    from llmserve.tokenizer.tokenizer import Tokenizer

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="GGUF file (default model)")
    ap.add_argument("--text", action="append", default=None, help="text file(s) to score")
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--combos", default="qkv_proj+head",
                    help="comma-separated sets of kinds (joined by +) moved together")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not native_int4_a8_available():
        print("the int4 x int8 kernel (AVX512-VNNI) is not available here", file=sys.stderr)
        return 2
    path = resolve_model_path(args.model)
    sets = [c.split("+") for c in args.combos.split(",") if c]
    known = {"qkv_proj", "o_proj", "gate_up_proj", "down_proj", "head"}
    unknown = sorted({k for kinds_moved in sets for k in kinds_moved} - known)
    if unknown:
        print(f"unknown kind(s) {unknown}; kinds: {sorted(known)}", file=sys.stderr)
        return 2
    texts = []
    for name in args.text or [TEXT_PATH]:
        with open(name, encoding="utf-8") as f:
            texts.append(f.read())
    text = "\n".join(texts)
    text_ids = Tokenizer.from_path(path).encode(text)[:args.max_tokens]
    settings = dict(PRESETS["packed"].settings)
    ref = gate.eval_engine(path, PRESETS["fp32"].settings, args.window, None)
    ref_logp, targets = gate.score_text(ref, text_ids, args.window)
    del ref
    a8 = gate.eval_engine(path, dict(settings, int4_activations="int8"), args.window, None)
    a16 = gate.eval_engine(path, dict(settings, int4_activations="bf16"), args.window, None)
    m8, m16 = a8.runner.model, a16.runner.model
    bf16_weights = dict(m16.named_modules())
    int8_weights = {n: m for n, m in m8.named_modules()
                    if isinstance(m, (Int4Weight, Int8Weight)) and m.int8_activations}
    kinds: dict[str, list[str]] = {}
    for name in int8_weights:
        kinds.setdefault(_kind(name), []).append(name)
    rows = []

    def report(label: str, moved: list[str]) -> None:
        for n in moved:
            _swap(m8, n, bf16_weights[n])
        logp, _ = gate.score_text(a8, text_ids, args.window)
        for n in moved:
            _swap(m8, n, int8_weights[n])
        row = dict(bf16=label, tokens=len(text_ids),
                   ppl=float(torch.exp(torch.tensor(metrics.mean_nll(logp, targets)))),
                   top1=metrics.top1_agreement(ref_logp, logp),
                   kl=metrics.mean_kl(ref_logp, logp))
        rows.append(row)
        print(f"bf16 activations in {label:<24} PPL {row['ppl']:.3f}  top-1 {row['top1']:.4f}  "
              f"KL {row['kl']:.5f}", flush=True)

    ref_ppl = float(torch.exp(torch.tensor(metrics.mean_nll(ref_logp, targets))))
    print(f"fp32 reference: PPL {ref_ppl:.3f} over {len(text_ids)} tokens", flush=True)
    report("nothing (int8)", [])
    report("everything (bf16)", list(int8_weights))
    for kinds_moved in [[k] for k in kinds] + sets:
        report("+".join(kinds_moved), [n for k in kinds_moved for n in kinds.get(k, [])])
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(dict(reference_ppl=ref_ppl, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
