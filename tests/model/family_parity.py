"""Shared parity checks of one tiny checkpoint against transformers (fp32).

Each family's test file builds its checkpoints and calls these four checks, the same ones
tests/model/test_parity.py runs for Llama/Qwen: prefill logits, step-by-step decode logits,
a batch of different lengths against each prompt alone, greedy tokens against
``transformers.generate``. Tolerance: 2e-4 absolute + 1e-4 relative on logits.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

from llmserve import LLM, SamplingParams
from llmserve.model.executor.capture import LogitsCapture
from tests.model.tiny_checkpoints import make_tiny_checkpoint

ATOL, RTOL = 2e-4, 1e-4


class StepRecorder:
    """Wraps the runner's execute to keep every step's logits by request id."""

    def __init__(self, llm: LLM, all_logits: bool = False) -> None:
        self.runner = llm.engine.runner
        self.runner.capture = LogitsCapture.SAMPLED | (LogitsCapture.ALL if all_logits
                                                       else LogitsCapture.NONE)
        self.steps: list = []
        inner = self.runner.execute

        def execute(step):
            out = inner(step)
            self.steps.append(out)
            return out

        self.runner.execute = execute

    def sampled_logits(self, rid: str) -> list[torch.Tensor]:
        """The logits of every step that sampled ``rid``, in order."""
        return [out.logits[out.request_ids.index(rid)] for out in self.steps
                if rid in out.request_ids]


def make_llm(path: str, **kw) -> LLM:
    args = dict(num_kv_blocks=64, block_size=16, dtype="float32", check_invariants=True,
                enable_prefix_caching=False)
    args.update(kw)
    return LLM(path, **args)


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def check_prefill(path: str, hf, prompts: list[list[int]], **llm_kw) -> None:
    llm = make_llm(path, **llm_kw)
    rec = StepRecorder(llm, all_logits=True)
    for prompt in prompts:
        rec.steps.clear()
        out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
        got = rec.steps[0].all_logits[out[0].request_id]
        torch.testing.assert_close(got, hf_logits(hf, prompt), atol=ATOL, rtol=RTOL)


def check_decode(path: str, hf, prompt: list[int], steps: int = 20, **llm_kw) -> None:
    llm = make_llm(path, **llm_kw)
    rec = StepRecorder(llm)
    out = llm.generate([prompt], SamplingParams(max_tokens=steps, temperature=0,
                                                ignore_eos=True))
    toks = out[0].outputs[0].token_ids
    ref = hf_logits(hf, prompt + toks)[len(prompt) - 1: len(prompt) - 1 + len(toks)]
    torch.testing.assert_close(torch.stack(rec.sampled_logits(out[0].request_id)), ref, atol=ATOL,
                               rtol=RTOL)


def check_batch_vs_alone(path: str, prompts: list[list[int]], **llm_kw) -> None:
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    llm = make_llm(path, **llm_kw)
    rec = StepRecorder(llm)
    alone = []
    for p in prompts:
        rec.steps.clear()
        out = llm.generate([p], params)[0]
        alone.append((out.outputs[0].token_ids, torch.stack(rec.sampled_logits(out.request_id))))
    rec.steps.clear()
    outs = llm.generate(prompts, params)
    assert max(len(s.request_ids) for s in rec.steps) == len(prompts)   # really batched
    for (tokens, logits), out in zip(alone, outs):
        assert out.outputs[0].token_ids == tokens
        torch.testing.assert_close(torch.stack(rec.sampled_logits(out.request_id)), logits, atol=ATOL,
                                   rtol=RTOL)


def check_greedy(path: str, hf, prompt: list[int], new_tokens: int = 24, **llm_kw) -> None:
    llm = make_llm(path, **llm_kw)
    out = llm.generate([prompt], SamplingParams(max_tokens=new_tokens, temperature=0,
                                                ignore_eos=True))
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
    assert out[0].outputs[0].token_ids == ref[0, len(prompt):].tolist()


def load_hf(path: str):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    hf.eval()
    return hf


def gguf_case(folder: Path, arch: str, overrides: dict, convert: Callable[[str, str], str],
              seed: int, **checkpoint_kw) -> tuple[str, Any, str]:
    """``(gguf path, transformers model, arch)``: a tiny ``arch`` checkpoint (4 heads, 2 KV
    heads, config ``overrides``) in ``folder``, converted to GGUF by ``convert(hf, out)``."""
    path = make_tiny_checkpoint(str(folder / "hf"), arch=arch, num_heads=4, num_kv_heads=2,
                                seed=seed, config_overrides=overrides, **checkpoint_kw)
    return convert(path, str(folder / "model.gguf")), load_hf(path), arch
