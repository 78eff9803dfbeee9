"""Mixture-of-experts families against transformers (fp32, tiny random checkpoints): Mixtral
(top-2 of 4, renormalised), Qwen2-MoE (top-2 of 6 unnormalised, a shared expert with its
sigmoid gate, a dense layer from mlp_only_layers), Qwen3-MoE (top-3 of 6, normalised, q/k
norm). The routers are drawn wide (tests/model/tiny_checkpoints.py) so expert choices are
not near-ties, and every prompt token reaches several experts in one batched call each.
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
MIXTRAL = {"num_local_experts": 4, "num_experts_per_tok": 2}
QWEN2_MOE = {"num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
             "shared_expert_intermediate_size": 96, "norm_topk_prob": False,
             "mlp_only_layers": [1]}
QWEN3_MOE = {"num_experts": 6, "num_experts_per_tok": 3, "moe_intermediate_size": 32,
             "norm_topk_prob": True}
CASES = [pytest.param(("mixtral", MIXTRAL), id="mixtral"),
         pytest.param(("qwen2_moe", QWEN2_MOE), id="qwen2_moe"),
         pytest.param(("qwen3_moe", QWEN3_MOE), id="qwen3_moe")]


@pytest.fixture(scope="module", params=CASES)
def moe(request, tmp_path_factory):
    arch, overrides = request.param
    path = make_tiny_checkpoint(str(tmp_path_factory.mktemp(arch)), arch=arch, num_heads=4,
                                num_kv_heads=2, seed=13, config_overrides=overrides)
    return path, load_hf(path)


def test_config(moe):
    cfg = load_model_config(moe[0])
    assert cfg.num_experts in (4, 6) and cfg.num_experts_per_tok in (2, 3)
    if cfg.architecture == "qwen2_moe":
        assert cfg.shared_expert_intermediate_size == 96 and not cfg.norm_topk_prob
        assert [cfg.is_sparse_layer(i) for i in range(2)] == [True, False]


def test_prefill_logits_match(moe):
    check_prefill(*moe, PROMPTS)


def test_decode_logits_match_step_by_step(moe):
    check_decode(*moe, PROMPTS[1], steps=10)


def test_batch_of_different_lengths_matches_each_alone(moe):
    check_batch_vs_alone(moe[0], PROMPTS)


def test_greedy_generation_matches_transformers_generate(moe):
    check_greedy(*moe, PROMPTS[1])
