"""Gemma 2 and Gemma 3 against transformers (fp32, tiny random checkpoints).

Layer 0 slides over a 12-position window, layer 1 is global (alternating local/global);
Gemma 2 soft-caps attention scores and final logits with small caps, so the tanh is far from
linear on these random weights; Gemma 3 adds q/k norms and a separate local rope base, and
caps only the final logits (its attention ignores attn_logit_softcapping, as transformers').
Also checked: (1 + w) norms and the sqrt(hidden) embedding scale (every weight random).
"""
from __future__ import annotations

import pytest

from llmserve.model.loading.loader import load_model_config
from tests.model.family_parity import (
    check_batch_vs_alone,
    check_decode,
    check_greedy,
    check_prefill,
    load_hf,
)
from tests.model.tiny_checkpoints import make_tiny_checkpoint

pytest.importorskip("transformers")

PROMPTS = [[5, 17, 300, 42, 9, 1000, 77], list(range(100, 137)), [11, 12]]
LAYERS = ["sliding_attention", "full_attention"]
GEMMA2 = {"sliding_window": 12, "layer_types": LAYERS, "attn_logit_softcapping": 0.5,
          "final_logit_softcapping": 3.0, "query_pre_attn_scalar": 24,
          "hidden_activation": "gelu_pytorch_tanh"}
GEMMA3 = {"sliding_window": 12, "layer_types": LAYERS, "query_pre_attn_scalar": 24,
          "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                              "sliding_attention": {"rope_type": "default",
                                                    "rope_theta": 1e4}}}
CASES = [pytest.param(("gemma2", GEMMA2, False), id="gemma2"),
         pytest.param(("gemma3", GEMMA3, True), id="gemma3-tied"),
         pytest.param(("gemma3", dict(GEMMA3, attn_logit_softcapping=1.0,
                                      final_logit_softcapping=5.0), False), id="gemma3-capped")]


@pytest.fixture(scope="module", params=CASES)
def gemma(request, tmp_path_factory):
    arch, overrides, tie = request.param
    path = make_tiny_checkpoint(str(tmp_path_factory.mktemp(arch)), arch=arch, num_heads=4,
                                num_kv_heads=2, seed=5, tie=tie, config_overrides=overrides)
    return path, load_hf(path)


def test_config(gemma):
    cfg = load_model_config(gemma[0])
    assert [cfg.layer_window(i) for i in range(2)] == [12, None]
    assert cfg.query_pre_attn_scalar == 24 and cfg.hidden_act == "gelu_pytorch_tanh"
    if cfg.architecture == "gemma3":
        assert cfg.qk_norm and cfg.local_rope_theta == 1e4 and cfg.rope_theta == 1e6
        assert cfg.attn_logit_softcapping is None


def test_prefill_logits_match(gemma):
    check_prefill(*gemma, PROMPTS)


def test_decode_logits_match_step_by_step(gemma):
    check_decode(*gemma, PROMPTS[1], steps=10)


def test_batch_of_different_lengths_matches_each_alone(gemma):
    check_batch_vs_alone(gemma[0], PROMPTS)


def test_greedy_generation_matches_transformers_generate(gemma):
    check_greedy(*gemma, PROMPTS[1])
