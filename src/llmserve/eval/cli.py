"""``llmserve eval``: print the quality gate's table; exit 1 when a configuration fails."""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict


def cmd_eval(args: argparse.Namespace) -> int:
    from llmserve.eval.gate import format_table, run_gate
    from llmserve.eval.presets import PRESETS

    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    results = run_gate(args.model, configs, reference=args.reference, max_tokens=args.max_tokens,
                       window=args.window, continuation_tokens=args.continuation_tokens,
                       num_threads=args.num_threads)
    print(f"reference: {args.reference}; text: {args.max_tokens} tokens in windows of "
          f"{args.window}; greedy: {args.continuation_tokens} tokens x prompts")
    print(format_table(results))
    failed = [r.name for r in results if r.passed is False]
    if args.json:
        rows = []
        for r in results:
            row = asdict(r)
            row.pop("greedy")
            row["thresholds"] = asdict(PRESETS[r.name].thresholds)
            rows.append(row)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"reference": args.reference, "results": rows, "failed": failed}, f,
                      indent=2)
    if failed:
        print(f"quality gate FAILED: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def add_eval_parser(sub) -> None:
    """Register ``eval`` under the top-level sub-parsers."""
    from llmserve.eval.presets import DEFAULT_CONFIGS, PRESETS

    p = sub.add_parser("eval", help="quality gate: perplexity, top-1 agreement, KL and greedy "
                                    "agreement of engine configurations vs a reference")
    p.add_argument("--model", default=None, help="HF folder or .gguf file (default model)")
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                   help=f"comma-separated presets from {sorted(PRESETS)}")
    p.add_argument("--reference", default="fp32", choices=sorted(PRESETS))
    p.add_argument("--max-tokens", type=int, default=512, help="tokens of the fixed text scored")
    p.add_argument("--window", type=int, default=256, help="tokens per scored window")
    p.add_argument("--continuation-tokens", type=int, default=32)
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--json", default=None, help="write the results to this JSON file")
    p.set_defaults(func=cmd_eval)
