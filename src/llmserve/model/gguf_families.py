"""What differs per family in a GGUF file: architecture names, tensor names, config keys.

llama.cpp names tensors per layer (``blk.{i}.attn_q.weight``); this module maps them to the
Hugging Face names the family's model class loads (models/registry.py), so GGUF and HF
checkpoints reach the model through the same ``load_weights``. Mixture-of-experts files
store each layer's experts as one 3-D tensor ``(experts, rows, cols)``; :func:`hf_names`
returns one HF name per expert and the loader hands the experts over one at a time::

    blk.{i}.ffn_gate_inp          router            mixtral: block_sparse_moe.gate
                                                    qwen*moe: mlp.gate
    blk.{i}.ffn_{gate,up,down}_exps   (E, I, H)     mixtral: block_sparse_moe.experts.{e}.w1/w3/w2
                                                    qwen*moe: mlp.experts.{e}.{gate,up,down}_proj
    blk.{i}.ffn_{gate,up,down}_shexp  shared expert  mlp.shared_expert.{gate,up,down}_proj
    blk.{i}.ffn_gate_inp_shexp    (H,)              mlp.shared_expert_gate (as (1, H))

Mixtral files say ``general.architecture = llama`` and carry ``llama.expert_count``.
This module imports no torch (the tokenizer reads GGUF metadata through gguf_loader).
"""
from __future__ import annotations

from typing import Any

#: GGUF ``general.architecture`` -> ModelConfig.architecture (llama + experts -> mixtral).
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
                      "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}
#: Families whose GGUF routing weights are renormalised by llama.cpp (its build_moe_ffn flag).
_NORMALISED_ROUTING = {"mixtral": True, "qwen2_moe": False, "qwen3_moe": True}

GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# Per-layer GGUF tensor suffix -> HF suffix under model.layers.{i}.
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_QWEN_MOE_NAMES = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_EXPERT_NAMES = {
    "mixtral": {"ffn_gate_exps": "block_sparse_moe.experts.{}.w1",
                "ffn_up_exps": "block_sparse_moe.experts.{}.w3",
                "ffn_down_exps": "block_sparse_moe.experts.{}.w2"},
    "qwen_moe": {"ffn_gate_exps": "mlp.experts.{}.gate_proj",
                 "ffn_up_exps": "mlp.experts.{}.up_proj",
                 "ffn_down_exps": "mlp.experts.{}.down_proj"},
}


def model_architecture(gguf_arch: str, metadata: dict[str, Any]) -> str:
    """ModelConfig.architecture of a file; ValueError names the supported ones."""
    if gguf_arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {gguf_arch!r} is not supported; "
                         f"supported: {sorted(GGUF_ARCHITECTURES)}")
    if gguf_arch == "llama" and int(metadata.get("llama.expert_count", 0) or 0) > 0:
        return "mixtral"
    return GGUF_ARCHITECTURES[gguf_arch]


def moe_config_fields(gguf_arch: str, arch: str, metadata: dict[str, Any],
                      tensors: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig's expert fields from ``<arch>.expert_*`` keys (empty for dense models)."""
    if arch not in _NORMALISED_ROUTING:
        return {}

    def key(name: str, default: Any = None) -> Any:
        return metadata.get(f"{gguf_arch}.{name}", default)

    if key("expert_count") is None or key("expert_used_count") is None:
        raise ValueError(f"{arch} GGUF lacks {gguf_arch}.expert_count / expert_used_count")
    fields: dict[str, Any] = dict(
        num_experts=int(key("expert_count")), num_experts_per_tok=int(key("expert_used_count")),
        norm_topk_prob=bool(key("expert_weights_norm", _NORMALISED_ROUTING[arch])))
    expert_ff = key("expert_feed_forward_length")
    if expert_ff is not None:
        fields["moe_intermediate_size"] = int(expert_ff)
    if "blk.0.ffn_gate_shexp.weight" in tensors:
        shared = key("expert_shared_feed_forward_length")
        fields["shared_expert_intermediate_size"] = int(
            shared if shared is not None else tensors["blk.0.ffn_gate_shexp.weight"].shape[0])
    return fields


def hf_names(arch: str, gguf_name: str, num_experts: int = 0) -> list[str]:
    """The HF name(s) of a llama.cpp tensor: one, or one per expert for a 3-D expert tensor.

    Raises:
        ValueError: a tensor this loader does not know.
    """
    stem, _, kind = gguf_name.rpartition(".")
    if kind not in ("weight", "bias"):
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
    if stem in GLOBAL_NAMES:
        return [f"{GLOBAL_NAMES[stem]}.{kind}"]
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit():
        prefix, sub = f"model.layers.{int(parts[1])}.", parts[2]
        if sub in LAYER_NAMES:
            return [f"{prefix}{LAYER_NAMES[sub]}.{kind}"]
        family = "mixtral" if arch == "mixtral" else "qwen_moe"
        if arch in _NORMALISED_ROUTING and sub in _EXPERT_NAMES[family]:
            template = _EXPERT_NAMES[family][sub]
            return [f"{prefix}{template.format(e)}.{kind}" for e in range(num_experts)]
        if arch == "mixtral" and sub == "ffn_gate_inp":
            return [f"{prefix}block_sparse_moe.gate.{kind}"]
        if arch in ("qwen2_moe", "qwen3_moe") and sub in _QWEN_MOE_NAMES:
            return [f"{prefix}{_QWEN_MOE_NAMES[sub]}.{kind}"]
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart in this loader")
