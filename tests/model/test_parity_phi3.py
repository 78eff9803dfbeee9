"""Phi-3 against transformers (fp32, tiny random checkpoints): fused qkv_proj / gate_up_proj
tensors and LongRoPE (both factor sets).

LongRoPE's factor set is fixed per engine (docs/MODELS.md): an engine whose context fits the
pretraining length (32 here) uses the short factors, a longer one the long factors. The
reference is transformers on sequences of the matching side: all shorter than 32 tokens for
the short engine, all longer for the long one (transformers picks the set by length).
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

ORIGINAL = 32
_HALF = 8   # head_dim 16 / 2
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": [1.0 + 0.1 * i for i in range(_HALF)],
            "long_factor": [1.0 + 0.9 * i for i in range(_HALF)]}
SHORT_PROMPTS = [[5, 17, 300, 42, 9, 1000, 77], list(range(100, 121)), [11, 12]]
LONG_PROMPTS = [list(range(100, 137)), list(range(300, 345)), list(range(7, 40))]
# (rope, engine max_model_len, prompts)
CASES = [pytest.param((LONGROPE, ORIGINAL, SHORT_PROMPTS), id="longrope-short"),
         pytest.param((LONGROPE, None, LONG_PROMPTS), id="longrope-long")]


@pytest.fixture(scope="module", params=CASES)
def phi3(request, tmp_path_factory):
    rope, max_len, prompts = request.param
    overrides = {"original_max_position_embeddings": ORIGINAL, "max_position_embeddings": 128}
    if rope:
        overrides["rope_parameters"] = dict(rope)
    path = make_tiny_checkpoint(str(tmp_path_factory.mktemp("phi3")), arch="phi3",
                                num_heads=4, num_kv_heads=2, seed=7, config_overrides=overrides)
    return path, load_hf(path), {"max_model_len": max_len} if max_len else {}, prompts


def test_config(phi3):
    cfg = load_model_config(phi3[0])
    assert cfg.architecture == "phi3"
    if cfg.rope_scaling:
        assert cfg.rope_scaling["rope_type"] == "longrope"
        assert cfg.rope_scaling["original_max_position_embeddings"] == ORIGINAL
        assert cfg.rope_scaling["factor"] == 128 / ORIGINAL


def test_prefill_logits_match(phi3):
    path, hf, kw, prompts = phi3
    check_prefill(path, hf, prompts, **kw)


def test_decode_logits_match_step_by_step(phi3):
    path, hf, kw, prompts = phi3
    check_decode(path, hf, prompts[0], steps=10, **kw)


def test_batch_of_different_lengths_matches_each_alone(phi3):
    path, _, kw, prompts = phi3
    check_batch_vs_alone(path, prompts, **kw)


def test_greedy_generation_matches_transformers_generate(phi3):
    path, hf, kw, prompts = phi3
    check_greedy(path, hf, prompts[0], new_tokens=16 if kw else 24, **kw)
