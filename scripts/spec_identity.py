"""Are greedy answers with speculation identical to plain decoding? (docs/SPECULATIVE.md)

Runs the ``extractive`` and ``agent-edit`` bench workloads (each prompt alone, as at c=1,
``max_tokens`` as the bench sets it, ``ignore_eos``) on the default model (or ``--model``)
without speculation and with each ``--methods`` entry, and prints per workload how many
answers are token-for-token identical, with the first differing position of any other.

    PYTHONPATH=src python scripts/spec_identity.py --methods ngram,suffix --k 7 \
        --num-prompts 6 --seeds 1,2,3
"""
from __future__ import annotations

import argparse
import json

from llmserve import LLM, SamplingParams
from llmserve.bench.agent_edit import agent_edit_workload
from llmserve.bench.extractive import extractive_workload

WORKLOADS = {"extractive": (extractive_workload, 160), "agent-edit": (agent_edit_workload, 256)}


def answers(llm: LLM, prompts: list[list[int]], lengths: list[int]) -> list[list[int]]:
    """Greedy token ids of each prompt, one request at a time."""
    out = []
    for prompt, n in zip(prompts, lengths):
        params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        out.append(list(llm.generate([prompt], params)[0].outputs[0].token_ids))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: the default model")
    p.add_argument("--methods", default="ngram,suffix")
    p.add_argument("--k", type=int, default=7)
    p.add_argument("--num-prompts", type=int, default=6)
    p.add_argument("--seeds", default="1,2,3")
    args = p.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    runs: dict[str, LLM] = {"plain": LLM(args.model)}
    for method in args.methods.split(","):
        runs[method] = LLM(args.model, speculative_method=method,
                           num_speculative_tokens=args.k)
    tok = runs["plain"].engine.tokenizer
    report = {}
    for name, (make, input_len) in WORKLOADS.items():
        specs = [s for seed in seeds for s in make(tok, args.num_prompts, input_len, seed=seed)]
        prompts = [tok.encode_chat(s.messages) for s in specs]   # as the server encodes
        lengths = [s.output_len for s in specs]
        got = {run: answers(llm, prompts, lengths) for run, llm in runs.items()}
        for method in runs:
            if method == "plain":
                continue
            firsts = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None)
                      for x, y in zip(got["plain"], got[method])]
            same = sum(f is None for f in firsts)
            report[f"{name}/{method}"] = {"identical": same, "prompts": len(specs),
                                          "first_difference": [f for f in firsts if f is not None]}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
