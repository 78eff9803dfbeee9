"""Build tiny, random, complete model checkpoints for tests (HF folders and GGUF files).

``make_tiny_checkpoint`` saves a random transformers Llama/Qwen2/Qwen3 model (safetensors,
optionally sharded) plus the default model's tokenizer, so the folder loads like any HF model.
Every parameter, norms and biases included, is drawn from a seeded generator, so parity tests
exercise all of them (transformers would initialise norms to 1 and biases to 0).

``make_tiny_gguf`` writes such a Llama folder as a GGUF file the way llama.cpp's converter does
(renamed tensors, Q/K rows permuted into llama.cpp's rotary layout, optional Q8_0 quantization).
"""
from __future__ import annotations

import functools
import json
import os
from typing import Any, Callable, Optional, Union

import numpy as np
import torch

from llmserve.default_model import default_model_path
from llmserve.tokenizer.tokenizer import Tokenizer

DEFAULT_VOCAB_SIZE = 49152
BOS_ID, EOS_ID = 1, 2   # <|im_start|>, <|im_end|> in the default tokenizer


@functools.lru_cache(maxsize=1)
def default_tokenizer() -> Tokenizer:
    """The default model's tokenizer, rebuilt from its GGUF (cached per process)."""
    return Tokenizer.from_path(default_model_path())


def _config(arch: str, **kw):
    import transformers
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    classes = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}
    classes.update({name: getattr(transformers, cls) for name, cls in (
        ("mistral", "MistralConfig"), ("gemma2", "Gemma2Config"), ("gemma3", "Gemma3TextConfig"),
        ("phi3", "Phi3Config"), ("mixtral", "MixtralConfig"), ("qwen2_moe", "Qwen2MoeConfig"),
        ("qwen3_moe", "Qwen3MoeConfig"))})
    if arch not in classes:
        raise ValueError(f"arch must be one of {sorted(classes)}, got {arch!r}")
    return classes[arch](**kw)


def _randomize(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen) * 0.05
            if name.endswith("mlp.gate.weight"):   # MoE router: well-separated expert scores
                noise = noise * 40
            param.copy_(noise + 1.0 if "norm" in name else noise)


def make_tiny_checkpoint(
    directory: str,
    arch: str = "llama",
    num_heads: int = 4,
    num_kv_heads: int = 2,
    hidden: int = 64,
    layers: int = 2,
    seed: int = 0,
    vocab_size: Optional[int] = None,
    rope_scaling: Optional[dict] = None,
    tie: bool = False,
    dtype: torch.dtype = torch.float32,
    max_position_embeddings: int = 512,
    head_dim: Optional[int] = None,
    intermediate: Optional[int] = None,
    rope_theta: float = 10000.0,
    max_shard_size: Optional[Union[str, int]] = None,
    with_tokenizer: bool = True,
    config_overrides: Optional[dict] = None,
) -> str:
    """Save a random tiny ``arch`` model (+ tokenizer) into ``directory``; return the path.

    ``head_dim`` defaults to ``hidden // num_heads`` and is always written, so MHA
    (``num_kv_heads == num_heads``), GQA and MQA (``num_kv_heads == 1``) are all possible.
    ``vocab_size`` may only grow the default 49152 (a padded vocabulary); the tokenizer is
    never truncated (without ``with_tokenizer`` any size goes). ``max_shard_size`` (e.g. ``"1MB"``) writes sharded safetensors + index.
    ``config_overrides`` adds or replaces config keys (sliding_window, experts, soft-caps...).
    """
    from transformers import AutoModelForCausalLM

    vocab = DEFAULT_VOCAB_SIZE if vocab_size is None else vocab_size
    if with_tokenizer and vocab < DEFAULT_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be >= {DEFAULT_VOCAB_SIZE} (the tokenizer is not truncated)")
    kwargs = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate or 2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim or hidden // num_heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-6,
        rope_theta=rope_theta,
        rope_scaling=dict(rope_scaling) if rope_scaling else None,   # transformers edits it in place
        tie_word_embeddings=tie,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=EOS_ID,
    )
    kwargs.update(config_overrides or {})
    config = _config(arch, **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    _randomize(model, seed)
    model = model.to(dtype)
    os.makedirs(directory, exist_ok=True)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size is not None else {}
    model.save_pretrained(directory, safe_serialization=True, **kwargs)
    if with_tokenizer:
        default_tokenizer().save_pretrained(directory)
    return directory


def make_sharded_checkpoint(directory: str, max_shard_size: str = "1MB", **kwargs) -> str:
    """:func:`make_tiny_checkpoint` with sharded safetensors and ``model.safetensors.index.json``."""
    path = make_tiny_checkpoint(directory, max_shard_size=max_shard_size, **kwargs)
    if not os.path.isfile(os.path.join(path, "model.safetensors.index.json")):
        raise RuntimeError("sharding produced no index file; lower max_shard_size")
    return path


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter permutation of Q/K rows (HF halves -> interleaved pairs)."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


_GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _gguf_name(hf_name: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf_name in top:
        return top[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_GGUF_LAYER_NAMES[module]}.{kind}"


def _add_default_tokenizer(writer) -> None:
    """Copy the default model's GGUF tokenizer (byte-level BPE) into ``writer``."""
    from llmserve.model.loading.gguf import read_gguf

    meta = read_gguf(default_model_path()).metadata
    writer.add_tokenizer_model(meta["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    writer.add_token_list(meta["tokenizer.ggml.tokens"])
    writer.add_token_types(meta["tokenizer.ggml.token_type"])
    writer.add_token_merges(meta["tokenizer.ggml.merges"])
    writer.add_add_bos_token(False)
    if "tokenizer.chat_template" in meta:
        writer.add_chat_template(meta["tokenizer.chat_template"])


_K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")


def make_tiny_gguf(hf_dir: str, out_path: str, quant: str = "F32", arch: str = "llama",
                   embedding_quant: Optional[str] = None, with_tokenizer: bool = False,
                   tokenizer_writer: Optional[Callable[[Any], None]] = None) -> str:
    """Convert a tiny HF *Llama* folder to GGUF as llama.cpp would; return ``out_path``.

    ``quant`` is a ``GGMLQuantizationType`` name such as ``"F32"``, ``"F16"``, ``"Q8_0"`` or
    ``"Q4_1"``: 2-D weights are quantized; for the K-quants (``"Q4_K"``, ``"Q5_K"``,
    ``"Q6_K"``), which the ``gguf`` package cannot write, they are random valid blocks of
    the tensor's shape instead (small scales: the values are not the checkpoint's, the
    shapes are). Norms and, to keep this fast, the large token
    embedding stay F32 unless ``embedding_quant`` names its type (a K-quant: random blocks
    too). ``with_tokenizer`` copies
    the default model's tokenizer in, so an engine can open the file; ``tokenizer_writer``
    (called with the ``GGUFWriter``) writes another tokenizer instead. ``arch`` is
    written as ``general.architecture`` (tests pass an unsupported one to check the error).
    """
    import gguf
    from safetensors.numpy import load_file

    with open(os.path.join(hf_dir, "config.json"), encoding="utf-8") as handle:
        cfg = json.load(handle)
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    writer = gguf.GGUFWriter(out_path, arch)
    add_decoder_hparams(writer, cfg)
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    if tokenizer_writer is not None:
        tokenizer_writer(writer)
    elif with_tokenizer:
        _add_default_tokenizer(writer)
    qtype = gguf.GGMLQuantizationType[quant]
    file_type = {"F32": "ALL_F32", "Q4_K": "MOSTLY_Q4_K_M", "Q5_K": "MOSTLY_Q5_K_M"}.get(
        quant, f"MOSTLY_{quant}")
    writer.add_file_type(gguf.LlamaFileType[file_type])
    tensors = {}
    for name in sorted(os.listdir(hf_dir)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(hf_dir, name)))
    for hf_name, value in tensors.items():
        value = value.astype(np.float32)
        if hf_name.endswith("self_attn.q_proj.weight"):
            value = llama_cpp_permute(value, heads)
        elif hf_name.endswith("self_attn.k_proj.weight"):
            value = llama_cpp_permute(value, kv_heads)
        embedding = "embed_tokens" in hf_name
        kind = embedding_quant if embedding else quant
        if embedding and embedding_quant is not None and embedding_quant not in _K_QUANTS:
            etype = gguf.GGMLQuantizationType[embedding_quant]
            writer.add_tensor(_gguf_name(hf_name), gguf.quants.quantize(value, etype), raw_dtype=etype)
        elif value.ndim == 2 and kind in _K_QUANTS:
            from tests.model.quant_helpers import gguf_blocks
            ktype = gguf.GGMLQuantizationType[kind]
            blocks = gguf_blocks(ktype, *value.shape, seed=len(tensors) + sum(map(ord, hf_name)),
                                 super_scale=2e-5)
            writer.add_tensor(_gguf_name(hf_name), blocks.data, raw_dtype=ktype)
        elif value.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32 and "embed_tokens" not in hf_name:
            writer.add_tensor(_gguf_name(hf_name), gguf.quants.quantize(value, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(_gguf_name(hf_name), np.ascontiguousarray(value))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path


def add_decoder_hparams(writer, cfg: dict, rope: bool = True) -> None:
    """The GGUF hyper-parameters every tiny decoder file has, from its HF ``config.json``
    (``rope=False``: the caller writes the rotary keys itself)."""
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_key_length(cfg["head_dim"])
    writer.add_value_length(cfg["head_dim"])
    if rope:
        writer.add_rope_dimension_count(cfg["head_dim"])
        writer.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(cfg["vocab_size"])
