"""Mixture-of-experts GGUF files (llama.cpp's tensor names, experts stacked 3-D) against
transformers on the HF folder they were converted from: Mixtral (``llama`` + experts),
Qwen2-MoE (shared expert, q/k/v bias), Qwen3-MoE (q/k norm). Also: a Q8_0 file's experts
reach a quantized linear method as one raw tensor per expert, equal to the dequantized ones.
"""
from __future__ import annotations

import numpy as np
import pytest

from llmserve.model.loading.loader import load_model_config, open_checkpoint
from tests.model.family_parity import check_greedy, check_prefill, gguf_case
from tests.model.test_parity_moe import MIXTRAL, QWEN3_MOE
from tests.model.tiny_checkpoints import make_tiny_checkpoint
from tests.model.tiny_gguf_families import make_tiny_moe_gguf

pytest.importorskip("transformers")

PROMPTS = [[5, 17, 300, 42, 9, 1000, 77], list(range(100, 137))]
QWEN2_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
             "shared_expert_intermediate_size": 96, "norm_topk_prob": False}
CASES = [pytest.param(("mixtral", MIXTRAL), id="mixtral"),
         pytest.param(("qwen2_moe", QWEN2_MOE), id="qwen2_moe"),
         pytest.param(("qwen3_moe", QWEN3_MOE), id="qwen3_moe")]


@pytest.fixture(scope="module", params=CASES)
def moe_gguf(request, tmp_path_factory):
    arch, overrides = request.param
    return gguf_case(tmp_path_factory.mktemp(arch), arch, overrides, make_tiny_moe_gguf, seed=17)


def test_config_from_gguf(moe_gguf):
    path, hf, arch = moe_gguf
    cfg = load_model_config(path)
    assert cfg.architecture == arch and cfg.source_format == "gguf"
    assert cfg.num_experts == getattr(hf.config, "num_local_experts", None) or \
        cfg.num_experts == hf.config.num_experts
    assert cfg.num_experts_per_tok == hf.config.num_experts_per_tok
    assert cfg.norm_topk_prob == (arch != "qwen2_moe")
    assert cfg.shared_expert_intermediate_size == (96 if arch == "qwen2_moe" else 0)


def test_prefill_logits_match(moe_gguf):
    path, hf, _ = moe_gguf
    check_prefill(path, hf, PROMPTS)


@pytest.mark.parametrize("moe_gguf", CASES[:1], indirect=True)   # decode: one file is enough
def test_greedy_generation_matches_transformers_generate(moe_gguf):
    path, hf, _ = moe_gguf
    check_greedy(path, hf, PROMPTS[1], new_tokens=16)


@pytest.fixture(scope="module")
def q8_moe(tmp_path_factory):
    folder = tmp_path_factory.mktemp("q8")
    hf_dir = make_tiny_checkpoint(str(folder / "hf"), arch="qwen2_moe", num_heads=4,
                                  num_kv_heads=2, seed=19, config_overrides=QWEN2_MOE)
    return make_tiny_moe_gguf(hf_dir, str(folder / "q8.gguf"), "Q8_0")


def test_quantized_experts_arrive_one_raw_tensor_each(q8_moe):
    source = open_checkpoint(q8_moe)
    dense = dict(source.iter_weights())
    raw = dict(source.iter_weights(raw_gguf=True))
    assert dense.keys() == raw.keys()
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    assert type(raw[name]).__name__ == "RawGGUFTensor" and raw[name].shape == (64, 32)
    for key, value in raw.items():
        if type(value).__name__ == "RawGGUFTensor":
            np.testing.assert_array_equal(value.dequantize(), dense[key])


def test_quantized_moe_gguf_serves_with_packed_experts(q8_moe, caplog):
    """bf16 + ``quantization auto``: every expert matrix is packed (Q8_0's own blocks where
    the int8-activation block kernel runs, int8 per channel elsewhere), the
    router stays dense, the compiled decode step is bypassed with a logged reason, and the
    greedy tokens equal the float32 dequantized run's on this tiny model."""
    from llmserve import LLM, SamplingParams

    path = q8_moe
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    with caplog.at_level("WARNING", logger="llmserve.model.executor.runner"):
        packed = LLM(path, dtype="bfloat16", num_kv_blocks=64, enforce_eager=False,
                     check_invariants=True)
    assert packed.engine.runner.compiled is None
    assert "mixture-of-experts" in caplog.text
    # 2 layers x (qkv, o, 4 experts x 2, shared expert x 2) + lm_head = 25 packed matrices
    from llmserve.model.quant.native_int8 import native_int8_a8_available
    from llmserve.model.quant.native_qblock import native_qblock_available
    # the file's Q8_0 blocks where the block kernel runs; else int8 per channel, with int8
    # activations where the tier's int8 x int8 kernel runs (the avx2 tier)
    fmt = "gguf-q8_0-a8" if native_qblock_available() else \
        "int8-a8" if native_int8_a8_available() else "int8"
    assert f"{fmt}x25" in packed.engine.runner.quantization
    dense = LLM(path, dtype="float32", num_kv_blocks=64)
    prompt = [list(range(100, 137))]
    assert packed.generate(prompt, params)[0].outputs[0].token_ids == \
        dense.generate(prompt, params)[0].outputs[0].token_ids
