"""Gemma 2, Gemma 3 and Phi-3 GGUF files (converted like llama.cpp: Gemma norms stored as
1 + w, sliding-window keys, soft-caps; Phi-3's fused attn_qkv / ffn_up and LongRoPE factor
tensors) against transformers on the HF folder they came from: prefill logits and greedy."""
from __future__ import annotations

import pytest

from llmserve.model.loading.loader import load_model_config
from tests.model.family_parity import check_greedy, check_prefill, gguf_case
from tests.model.test_parity_phi3 import LONGROPE, ORIGINAL
from tests.model.tiny_gguf_families import make_tiny_dense_gguf

pytest.importorskip("transformers")

PROMPTS = [[5, 17, 300, 42, 9, 1000, 77], list(range(100, 137))]
# llama.cpp scales Gemma attention by 1/sqrt(head_dim) (16 here) except for the 27B models
GEMMA2 = {"sliding_window": 12, "attn_logit_softcapping": 0.5, "final_logit_softcapping": 3.0,
          "query_pre_attn_scalar": 16}
GEMMA3 = {"sliding_window": 12, "layer_types": ["sliding_attention", "full_attention"],
          "query_pre_attn_scalar": 16, "final_logit_softcapping": 5.0,
          "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                              "sliding_attention": {"rope_type": "default",
                                                    "rope_theta": 1e4}}}
PHI3 = {"original_max_position_embeddings": ORIGINAL, "max_position_embeddings": 128,
        "rope_parameters": dict(LONGROPE)}
CASES = [pytest.param(("gemma2", GEMMA2), id="gemma2"),
         pytest.param(("gemma3", GEMMA3), id="gemma3"),
         pytest.param(("phi3", PHI3), id="phi3-longrope")]


@pytest.fixture(scope="module", params=CASES)
def dense_gguf(request, tmp_path_factory):
    arch, overrides = request.param
    return gguf_case(tmp_path_factory.mktemp(arch), arch, overrides, make_tiny_dense_gguf,
                     seed=23, tie=arch != "phi3")


def test_config_from_gguf(dense_gguf):
    path, _, arch = dense_gguf
    cfg = load_model_config(path)
    assert cfg.architecture == arch and cfg.source_format == "gguf"
    if arch == "phi3":
        assert cfg.rope_scaling["rope_type"] == "longrope"
        assert cfg.rope_scaling["original_max_position_embeddings"] == ORIGINAL
    else:
        assert [cfg.layer_window(i) for i in range(2)] == [12, None]
        assert cfg.hidden_act == "gelu_pytorch_tanh" and cfg.query_pre_attn_scalar == 16


def test_prefill_logits_match(dense_gguf):
    path, hf, arch = dense_gguf
    prompts = PROMPTS[1:] if arch == "phi3" else PROMPTS   # longer than 32: long factors
    check_prefill(path, hf, prompts)


@pytest.mark.parametrize("dense_gguf", CASES[:1], indirect=True)   # decode: one file is enough
def test_greedy_generation_matches_transformers_generate(dense_gguf):
    path, hf, _ = dense_gguf
    check_greedy(path, hf, PROMPTS[1], new_tokens=16)
