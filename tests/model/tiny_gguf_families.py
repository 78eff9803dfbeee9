"""Write tiny HF mixture-of-experts folders as GGUF files the way llama.cpp's converter does.

Mixtral becomes ``general.architecture = llama`` with ``llama.expert_count``; Qwen2-MoE and
Qwen3-MoE become ``qwen2moe`` / ``qwen3moe``. Each layer's experts are stacked into 3-D
``ffn_{gate,up,down}_exps`` tensors ``(experts, rows, cols)``, the router is ``ffn_gate_inp``,
Qwen2-MoE's shared expert ``ffn_*_shexp`` with its gate ``ffn_gate_inp_shexp`` stored 1-D,
and Llama-architecture Q/K rows are permuted into llama.cpp's rotary layout.
"""
from __future__ import annotations

import json
import os
import re

import numpy as np

from tests.model.tiny_checkpoints import BOS_ID, EOS_ID, _add_default_tokenizer, add_decoder_hparams, llama_cpp_permute

GGUF_ARCH = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}
_DENSE = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
          "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "block_sparse_moe.gate": "ffn_gate_inp",
          "mlp.gate": "ffn_gate_inp", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
          "mlp.shared_expert.up_proj": "ffn_up_shexp",
          "mlp.shared_expert.down_proj": "ffn_down_shexp",
          "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}
_EXPERT = re.compile(r"(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)")
_EXPERT_KIND = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down",
                "down_proj": "down"}


def _tensors(hf_dir: str) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    tensors = {}
    for name in sorted(os.listdir(hf_dir)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(hf_dir, name)))
    return {k: v.astype(np.float32) for k, v in tensors.items()}


def make_tiny_moe_gguf(hf_dir: str, out_path: str, quant: str = "F32") -> str:
    """Convert a tiny HF MoE folder (mixtral / qwen2_moe / qwen3_moe) to GGUF; return the path.

    ``quant`` (``F32``, ``Q8_0``, ...) applies to the 2-D and 3-D projection matrices."""
    import gguf

    with open(os.path.join(hf_dir, "config.json"), encoding="utf-8") as handle:
        cfg = json.load(handle)
    model_type = cfg["model_type"]
    arch = GGUF_ARCH[model_type]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    experts = cfg.get("num_local_experts") or cfg.get("num_experts")
    writer = gguf.GGUFWriter(out_path, arch)
    add_decoder_hparams(writer, cfg)
    writer.add_expert_count(experts)
    writer.add_expert_used_count(cfg["num_experts_per_tok"])
    if cfg.get("moe_intermediate_size"):
        writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if cfg.get("shared_expert_intermediate_size"):
        writer.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    _add_default_tokenizer(writer)
    qtype = gguf.GGMLQuantizationType[quant]
    writer.add_file_type(gguf.LlamaFileType["ALL_F32" if quant == "F32" else f"MOSTLY_{quant}"])

    def add(name: str, value: np.ndarray) -> None:
        if value.ndim >= 2 and qtype != gguf.GGMLQuantizationType.F32 and "token_embd" not in name:
            writer.add_tensor(name, gguf.quants.quantize(value, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, np.ascontiguousarray(value))

    stacked: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    for hf_name, value in _tensors(hf_dir).items():
        if hf_name in top:
            add(top[hf_name], value)
            continue
        _, _, layer, rest = hf_name.split(".", 3)
        module, kind = rest.rsplit(".", 1)
        match = _EXPERT.fullmatch(module)
        if match:
            stacked.setdefault((int(layer), _EXPERT_KIND[match.group(2)]), {})[
                int(match.group(1))] = value
            continue
        if arch == "llama" and module == "self_attn.q_proj":
            value = llama_cpp_permute(value, heads)
        elif arch == "llama" and module == "self_attn.k_proj":
            value = llama_cpp_permute(value, kv_heads)
        elif module == "mlp.shared_expert_gate":
            value = value.reshape(-1)
        add(f"blk.{layer}.{_DENSE[module]}.{kind}", value)
    for (layer, kind), per_expert in sorted(stacked.items()):
        add(f"blk.{layer}.ffn_{kind}_exps.weight",
            np.stack([per_expert[e] for e in range(experts)]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path


_GEMMA_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
                "pre_feedforward_layernorm": "ffn_norm",
                "post_feedforward_layernorm": "post_ffw_norm"}
_PHI3_NAMES = {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",
               "post_attention_layernorm": "ffn_norm"}


def _write_common(writer, cfg: dict) -> None:
    add_decoder_hparams(writer, cfg, rope=False)
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    _add_default_tokenizer(writer)


def make_tiny_dense_gguf(hf_dir: str, out_path: str) -> str:
    """Convert a tiny HF Gemma 2 / Gemma 3 / Phi-3 folder to an F32 GGUF as llama.cpp's
    converter does (Gemma norms stored as 1 + w, Phi-3's fused tensors and LongRoPE factor
    tensors); return the path."""
    import gguf

    with open(os.path.join(hf_dir, "config.json"), encoding="utf-8") as handle:
        cfg = json.load(handle)
    arch = {"gemma2": "gemma2", "gemma3_text": "gemma3", "phi3": "phi3"}[cfg["model_type"]]
    writer = gguf.GGUFWriter(out_path, arch)
    _write_common(writer, cfg)
    rope = cfg.get("rope_parameters") or {}
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        writer.add_sliding_window(cfg["sliding_window"])
        writer.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    elif arch == "gemma3":
        writer.add_sliding_window(cfg["sliding_window"])
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in cfg["layer_types"]])
        writer.add_rope_freq_base(rope["full_attention"]["rope_theta"])
        writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
        if cfg.get("final_logit_softcapping"):
            writer.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    else:
        writer.add_rope_dimension_count(cfg["head_dim"])
        writer.add_rope_freq_base(rope.get("rope_theta", 10000.0))
        writer.add_sliding_window(cfg.get("sliding_window") or 0)
        original = cfg["original_max_position_embeddings"]
        writer.add_rope_scaling_orig_ctx_len(original)
        if rope.get("long_factor"):
            scale = cfg["max_position_embeddings"] / original
            writer.add_rope_scaling_attn_factors(
                float(np.sqrt(1 + np.log(scale) / np.log(original))) if scale > 1 else 1.0)
            writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], np.float32))
            writer.add_tensor("rope_factors_short.weight",
                              np.array(rope["short_factor"], np.float32))
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    names = dict(_DENSE, **(_PHI3_NAMES if arch == "phi3" else _GEMMA_NAMES))
    for hf_name, value in _tensors(hf_dir).items():
        if arch != "phi3" and hf_name.endswith("norm.weight"):
            value = value + 1
        if hf_name in top:
            writer.add_tensor(top[hf_name], value)
            continue
        _, _, layer, rest = hf_name.split(".", 3)
        module, kind = rest.rsplit(".", 1)
        writer.add_tensor(f"blk.{layer}.{names[module]}.{kind}", value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path
