"""How the whitespace allowed between JSON tokens moves sampled validity (issue 30 item 6).

    python scripts/json_whitespace_sweep.py [--model FILE] [--per-schema 60]
        [--seeds 300,400,500] [--patterns default,unbounded,one-line] [--json FILE]

Runs the ``json-validity`` bench workload (its four schemas and prompts, chat requests at
temperature 1, at most 200 tokens, request ``i`` of a schema with seed ``seed + i``) offline
through ``LLM``, once per whitespace pattern and seed set, and prints each run's valid
answers per schema and how many answers hold a blank line or a space before a line break
between their tokens (whitespace the model emits on its own, and vLLM's unbounded default
lets through). The patterns are ``flexible``'s regular expression
(``llmserve.structured_output.spec.FLEXIBLE_WHITESPACE``): ``default`` (today's),
``unbounded`` (any run of spaces, tabs and line breaks, as vLLM allows) and ``one-line``
(the bound before issue 30's re-measure: one line break and its indentation). Same seeds,
same requests: the runs differ only in the pattern.
"""
from __future__ import annotations

import argparse
import collections
import json
import re
import sys

PATTERNS = {
    "unbounded": r"[\x20\x09\x0A\x0D]+",
    "one-line": r"[\x20\x09]{1,4}|\x0D?\x0A[\x20\x09]{0,32}",
}
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


def structural(text: str) -> str:
    """``text`` with every JSON string emptied: what is left is tokens and whitespace."""
    return _STRING.sub('""', text)


def run(model: str, pattern: str, seed: int, per_schema: int) -> dict:
    """One run of the workload with ``pattern``; its counts."""
    import llmserve.structured_output.spec as spec
    from llmserve import LLM, SamplingParams
    from llmserve.bench.json_validity import VALIDITY_SCHEMAS, score_answer

    saved = spec.FLEXIBLE_WHITESPACE
    spec.FLEXIBLE_WHITESPACE = pattern    # read when the engine's grammar compiler is built
    try:
        llm = LLM(model)
    finally:
        spec.FLEXIBLE_WHITESPACE = saved
    convs, params, names = [], [], []
    for i in range(per_schema):
        for name, prompt, schema in VALIDITY_SCHEMAS:
            convs.append([{"role": "user", "content": prompt}])
            params.append(SamplingParams(
                max_tokens=200, temperature=1.0, seed=seed + i,
                structured_output=spec.StructuredOutputSpec("json", schema)))
            names.append((name, schema))
    valid: "collections.Counter[str]" = collections.Counter()
    blank = space_break = 0
    for out, (name, schema) in zip(llm.chat(convs, params), names):
        text = out.outputs[0].text
        valid[name] += score_answer(text, out.outputs[0].finish_reason, schema) == "valid"
        blank += "\n\n" in structural(text)
        space_break += " \n" in structural(text)
    return {"seed": seed, "valid": sum(valid.values()), "requests": len(names),
            "per_schema": dict(valid), "blank_line": blank, "space_before_break": space_break}


def main(argv: "list[str] | None" = None) -> int:
    from llmserve.default_model import resolve_model_path
    from llmserve.structured_output.spec import FLEXIBLE_WHITESPACE

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model path (default: the default model)")
    ap.add_argument("--per-schema", type=int, default=60)
    ap.add_argument("--seeds", default="300,400,500")
    ap.add_argument("--patterns", default="default,unbounded,one-line")
    ap.add_argument("--json", default=None, help="write every run's counts here")
    args = ap.parse_args(argv)
    patterns = {"default": FLEXIBLE_WHITESPACE, **PATTERNS}
    names = args.patterns.split(",")
    unknown = [n for n in names if n not in patterns]
    if unknown:
        print(f"unknown pattern(s) {', '.join(unknown)}; known: {', '.join(patterns)}",
              file=sys.stderr)
        return 2
    model = resolve_model_path(args.model)
    results: dict[str, list[dict]] = {}
    for name in names:
        for seed in (int(s) for s in args.seeds.split(",")):
            r = run(model, patterns[name], seed, args.per_schema)
            results.setdefault(name, []).append(r)
            print(f"{name:10s} seed {seed}: valid {r['valid']}/{r['requests']} "
                  f"{r['per_schema']}  blank line {r['blank_line']}, space before a break "
                  f"{r['space_before_break']}", flush=True)
    for name, runs in results.items():
        print(f"{name:10s} total: valid {sum(r['valid'] for r in runs)}/"
              f"{sum(r['requests'] for r in runs)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"patterns": {n: patterns[n] for n in names}, "runs": results}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
