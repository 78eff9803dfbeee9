"""Where do greedy tokens with speculation first leave plain decoding? (docs/SPECULATIVE.md)

Runs one extractive prompt on a model without and with a speculative method, captures the
logits of every sampled row (``LogitsCapture.SAMPLED``) and prints, for each output
position whose logits are not bit-identical, the difference and the step that produced
each side: ``(rows of the sequence, sequences, decode-only, compiled verify, start)``.

    PYTHONPATH=src python scripts/spec_divergence.py --method ngram --k 5 [--eager-verify]
"""
from __future__ import annotations

import argparse

import torch

from llmserve import LLM, SamplingParams
from llmserve.bench.extractive import extractive_workload
from llmserve.model.executor.capture import LogitsCapture


class _VerifySpy:
    """Wraps the runner's compiled verify step to tell whether a step used it."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.used = False

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, *args, **kwargs):
        self.used = True
        return self.inner(*args, **kwargs)


def _run(llm: LLM, prompt: list[int], params: SamplingParams):
    runner = llm.engine.runner
    spy = runner.compiled_verify = (_VerifySpy(runner.compiled_verify)
                                    if runner.compiled_verify is not None else None)
    rows, kinds = [], []
    execute = runner.execute

    def capturing(step):
        if spy is not None:
            spy.used = False
        out = execute(step)
        if out.logits is not None:
            samples = dict(zip(step.request_ids, step.num_samples))
            first = 0
            for rid, tokens in zip(out.request_ids, out.token_ids):
                rows.extend(out.logits[first:first + len(tokens)])
                kind = (samples[rid], step.num_seqs, step.is_decode_only,
                        bool(spy and spy.used), step.start_positions[0])
                kinds.extend([kind] * len(tokens))
                first += samples[rid]
        return out

    runner.capture, runner.execute = LogitsCapture.SAMPLED, capturing
    try:
        tokens = llm.generate([prompt], params)[0].outputs[0].token_ids
    finally:
        runner.capture, runner.execute = LogitsCapture.NONE, execute
    return tokens, rows, kinds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: the default model")
    p.add_argument("--method", default="ngram", choices=["ngram", "suffix"])
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--prompt-index", type=int, default=1, help="extractive prompt (seed 0)")
    p.add_argument("--max-tokens", type=int, default=70)
    p.add_argument("--eager-verify", action="store_true",
                   help="never use the compiled verify step")
    args = p.parse_args()
    if args.eager_verify:
        from llmserve.model.executor.compiled_verify import CompiledVerifyStep
        CompiledVerifyStep.shape_for = lambda self, *a: None  # type: ignore[method-assign]
    results = []
    for spec in (False, True):
        kw = dict(speculative_method=args.method, num_speculative_tokens=args.k) if spec else {}
        llm = LLM(args.model, **kw)
        tok = llm.engine.tokenizer
        spec_req = extractive_workload(tok, args.prompt_index + 1, 160, seed=0)[args.prompt_index]
        prompt = tok.encode_chat(spec_req.messages)
        results.append(_run(llm, prompt, SamplingParams(max_tokens=args.max_tokens,
                                                        temperature=0)))
        del llm
    (t0, r0, k0), (t1, r1, k1) = results
    print(f"prompt: {len(prompt)} tokens; greedy tokens identical: {t0 == t1}")
    for i, (a, b) in enumerate(zip(r0, r1)):
        if not torch.equal(a, b):
            diff = (a.float() - b.float()).abs().max().item()
            print(f"token {i}: logits differ by {diff:.3g}; plain step {k0[i]}, "
                  f"speculative step {k1[i]}; tokens {t0[i]} / {t1[i]}")


if __name__ == "__main__":
    main()
