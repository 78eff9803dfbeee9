"""A GGUF file's :class:`ModelConfig`: ``<arch>.*`` metadata, plus the family's extras
(experts, sliding windows, soft-caps, LongRoPE factors: gguf_families). No tensor data is read
except LongRoPE's two small factor tensors. Imports numpy and gguf, not torch.
"""
from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
from gguf import LlamaFileType

from llmserve.model.config import ModelConfig
from llmserve.model.loading.gguf import GGUFFile, _architecture, dequantize_tensor
from llmserve.model.loading.gguf_families import (
    family_config_fields,
    model_architecture,
    moe_config_fields,
)


def gguf_quantization_name(gguf_file: GGUFFile) -> str:
    """The file's quantization as ``gguf:<type>`` (e.g. ``gguf:Q4_1``)."""
    file_type = gguf_file.metadata.get("general.file_type")
    if file_type is not None:
        try:
            name = LlamaFileType(int(file_type)).name
            return "gguf:" + name.removeprefix("MOSTLY_").removeprefix("ALL_")
        except ValueError:
            pass
    matrix_types = Counter(t.qtype.name for t in gguf_file.tensors.values() if len(t.shape) == 2)
    return "gguf:" + (matrix_types.most_common(1)[0][0] if matrix_types else "unknown")


def _f32(value: Any) -> float:
    """GGUF stores floats as float32; recover the decimal the writer meant (1e-5, not 9.99999974e-06)."""
    return float(str(np.float32(value)))


def _uniform(value: Any, key: str) -> int:
    """Some files store a per-layer list for head counts; we need one value."""
    if isinstance(value, list):
        if not value or len(set(value)) != 1:
            raise ValueError(f"GGUF key {key} varies per layer ({value[:8]}...), which is not supported")
        value = value[0]
    return int(value)


def _rope_scaling(meta: dict[str, Any], arch: str, gguf_file: GGUFFile) -> dict | None:
    if "rope_freqs.weight" in gguf_file.tensors:
        raise ValueError(
            f"{gguf_file.path!r} stores precomputed rope frequency factors (llama3-style rope "
            "scaling), which the GGUF loader does not support; load the HF folder instead"
        )
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    factor = _f32(meta.get(f"{arch}.rope.scaling.factor", 1.0))
    if kind in ("none", None) or factor == 1.0:
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        scaling = {"rope_type": "yarn", "factor": factor}
        original = meta.get(f"{arch}.rope.scaling.original_context_length")
        if original is not None:
            scaling["original_max_position_embeddings"] = int(original)
        return scaling
    raise ValueError(f"{gguf_file.path!r}: unsupported GGUF rope scaling type {kind!r}")


def _small_tensor(gguf_file: GGUFFile, name: str) -> "list[float] | None":
    """A small tensor's values (LongRoPE factors), or None when the file has none."""
    info = gguf_file.tensors.get(name)
    if info is None:
        return None
    data = np.memmap(gguf_file.path, dtype=np.uint8, mode="r")
    try:
        return [float(v) for v in dequantize_tensor(data, info).reshape(-1)]
    finally:
        del data


def gguf_model_config(gguf_file: GGUFFile) -> ModelConfig:
    """Build a :class:`ModelConfig` from ``<arch>.*`` metadata (no tensor data is read)."""
    arch = _architecture(gguf_file)
    meta = gguf_file.metadata

    def need(key: str) -> Any:
        full = f"{arch}.{key}"
        if full not in meta:
            raise ValueError(f"{gguf_file.path!r}: GGUF metadata lacks {full}")
        return meta[full]

    hidden = int(need("embedding_length"))
    num_heads = _uniform(need("attention.head_count"), f"{arch}.attention.head_count")
    num_kv_heads = _uniform(meta.get(f"{arch}.attention.head_count_kv", num_heads), f"{arch}.attention.head_count_kv")
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // num_heads))
    rope_dim = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ValueError(f"{gguf_file.path!r}: partial rotary embedding ({rope_dim} of {head_dim} dims) is not supported")
    tokens = meta.get("tokenizer.ggml.tokens")
    if f"{arch}.vocab_size" in meta:
        vocab_size = int(meta[f"{arch}.vocab_size"])
    elif tokens is not None:
        vocab_size = len(tokens)
    else:
        vocab_size = gguf_file.tensors["token_embd.weight"].shape[0]
    eos_ids = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                 "tokenizer.ggml.eom_token_id") if k in meta]
    bos = meta.get("tokenizer.ggml.bos_token_id")
    model_arch = model_architecture(arch, meta)
    try:
        moe = moe_config_fields(arch, model_arch, meta, gguf_file.tensors)
    except ValueError as exc:
        raise ValueError(f"{gguf_file.path!r}: {exc}") from None
    feed_forward = meta.get(f"{arch}.feed_forward_length", moe.get("moe_intermediate_size"))
    if feed_forward is None:
        need("feed_forward_length")
    fields = dict(
        architecture=model_arch,
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=_uniform(feed_forward, f"{arch}.feed_forward_length"),
        num_hidden_layers=int(need("block_count")),
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=int(need("context_length")),
        rms_norm_eps=_f32(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=_f32(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(meta, arch, gguf_file),
        tie_word_embeddings="output.weight" not in gguf_file.tensors,
        attention_bias="blk.0.attn_q.bias" in gguf_file.tensors,
        qk_norm="blk.0.attn_q_norm.weight" in gguf_file.tensors,
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos_ids)),
        source_format="gguf",
        quantization=gguf_quantization_name(gguf_file),
    )
    fields.update(moe)
    try:
        fields.update(family_config_fields(
            arch, model_arch, meta, layers=fields["num_hidden_layers"], hidden=hidden,
            heads=num_heads, head_dim=head_dim,
            read_tensor=lambda name: _small_tensor(gguf_file, name)))
    except ValueError as exc:
        raise ValueError(f"{gguf_file.path!r}: {exc}") from None
    return ModelConfig(**fields)
