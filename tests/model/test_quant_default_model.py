"""The default model (SmolLM2-135M, Q4_1 GGUF) with its weights kept packed, against the same
weights dequantized to float32.

Thresholds (measured on the development machine in brackets):
* packed weights resident <= 1.3x the file's tensor bytes          [0.98x]
* perplexity on the eval text within 0.5 % of fp32                 [-0.10 %]
* top-1 next-token agreement >= 93 %                                [96.7 %]
  (bf16 dense weights alone: 97.1 %)
* greedy continuations of 8 prompts x 16 tokens: >= 40 % of the tokens before the first
  difference on average                                            [50-66 %]
  (bf16 dense weights alone: 83 %; one near-tie token flips all that follow, so this moves
  with batch layout and rounding), and, teacher-forced along fp32's greedy continuations,
  the same next token at >= 90 % of the positions
"""
from __future__ import annotations

import pytest

from llmserve import LLM, SamplingParams
from llmserve.eval.gate import run_gate, run_prompts
from llmserve.eval.metrics import greedy_agreement
from llmserve.eval.presets import PROMPTS
from llmserve.model.loading.gguf import read_gguf
from llmserve.model.quant.native_int4 import native_int4_a8_available
from llmserve.model.quant.native_int8 import native_int8_a8_available

pytestmark = pytest.mark.slow

MORE_PROMPTS = ["The three primary colours are", "Python is a programming language that",
                "The largest planet in the solar system is", "To make a cup of tea, first"]


@pytest.fixture(scope="module")
def packed():
    return LLM(None, num_kv_blocks=128, dtype="bfloat16", quantization="auto")


def test_weights_stay_packed(packed):
    runner = packed.engine.runner
    a8 = "-a8" if native_int4_a8_available() else ""   # --int4-activations auto
    head = "-a8" if native_int8_a8_available() else ""  # the tied int8 LM head, the same
    assert runner.quantization == f"linear:int4-g32{a8}x120;embedding:int8{head}"
    file_bytes = sum(t.nbytes for t in read_gguf(packed.engine.model_path).tensors.values())
    assert runner.weight_bytes <= 1.3 * file_bytes


def test_capital_of_france(packed):
    params = SamplingParams(temperature=0, max_tokens=8)
    out = packed.generate(["The capital of France is"], params)[0]
    assert "Paris" in out.outputs[0].text


def test_capital_of_france_in_a_chat_with_bf16_activations():
    """The chat question's greedy answer is a near tie on this file: bf16 activations say
    Paris; int8 ones (--int4-activations auto on AVX512-VNNI) start "L'Étoile, la
    Marseillaise", as llama.cpp's llama-server does on the same file (Q4_1 x Q8_1)."""
    llm = LLM(None, num_kv_blocks=64, dtype="bfloat16", quantization="auto",
              int4_activations="bf16")
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=24))[0]
    assert "Paris" in out.outputs[0].text


def test_greedy_agreement_with_fp32_dequantized():
    prompts = list(PROMPTS) + MORE_PROMPTS
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    kw = dict(num_kv_blocks=128, enable_prefix_caching=False)
    ref = LLM(None, dtype="float32", quantization="none", **kw)
    ids = [ref.engine.tokenize(p)[1] for p in prompts]
    want = [o.outputs[0].token_ids for o in ref.generate(ids, params)]
    packed = LLM(None, dtype="bfloat16", quantization="auto", **kw)
    got = [o.outputs[0].token_ids for o in packed.generate(ids, params)]
    assert greedy_agreement(want, got) >= 0.4
    # teacher-forced along fp32's own greedy paths: the packed model picks the same next token
    _, logits = run_prompts(packed.engine, [p + w for p, w in zip(ids, want)], 1, capture=True)
    same = total = 0
    for p, w, rows in zip(ids, want, logits):
        picks = rows[len(p) - 1:len(p) - 1 + len(w)].argmax(-1).tolist()
        same += sum(a == b for a, b in zip(picks, w))
        total += len(w)
    assert same / total >= 0.9, same / total


def test_perplexity_within_half_a_percent():
    ref, res = run_gate(None, ["packed"], reference="fp32", max_tokens=512, window=256,
                        continuation_tokens=8)
    assert res.ppl_increase <= 0.005, res
    assert res.top1 >= 0.93, res
