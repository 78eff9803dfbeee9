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

Gemma 2/3 and Phi-3 follow llama.cpp's conventions (its converter and model loaders)::

    gemma*   norms stored as 1 + w (the loader subtracts 1: HF semantics); ffn_norm is the
             pre-feedforward norm, post_attention_norm / post_ffw_norm the sandwich norms;
             attention.sliding_window + sliding_window_pattern (bools, or n: every n-th layer
             global; default 2 for Gemma 2, 6 for Gemma 3); attention scale 1/sqrt(head_dim)
             except the 27B models (1/sqrt(hidden/heads)); local rope base rope.freq_base_swa
             (Gemma 3, default 10000)
    phi3     attn_qkv and ffn_up (gate and up rows) fused as in the HF checkpoint; LongRoPE
             factors in the rope_factors_long/short tensors, rope.scaling.attn_factor and
             rope.scaling.original_context_length; llama.cpp ignores phi3's sliding window

This module imports no torch (the tokenizer reads GGUF metadata through gguf_loader).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from llmserve.model.config import FULL_ATTENTION, SLIDING_ATTENTION, interleaved_layer_types

#: GGUF ``general.architecture`` -> ModelConfig.architecture (llama + experts -> mixtral).
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
                      "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gemma2": "gemma2",
                      "gemma3": "gemma3", "phi3": "phi3"}
#: tensors that configure rather than weigh (read into the config, never loaded)
CONFIG_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")
_GEMMA_LAYER_NAMES = {
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_PHI3_LAYER_NAMES = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
#: layer counts of the 27B models, whose attention scale is 1/sqrt(hidden / heads)
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
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


def _sliding_fields(gguf_arch: str, metadata: dict[str, Any], layers: int) -> dict[str, Any]:
    window = int(metadata.get(f"{gguf_arch}.attention.sliding_window", 0) or 0)
    if gguf_arch == "gemma2" and not window:
        window = 4096   # llama.cpp's Gemma 2 default
    if not window or gguf_arch == "phi3":
        return {}
    pattern = metadata.get(f"{gguf_arch}.attention.sliding_window_pattern",
                           2 if gguf_arch == "gemma2" else 6)
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise ValueError(f"{gguf_arch}.attention.sliding_window_pattern has {len(pattern)} "
                             f"entries for {layers} layers")
        types = tuple(SLIDING_ATTENTION if p else FULL_ATTENTION for p in pattern)
    else:
        types = interleaved_layer_types(layers, int(pattern))
    if SLIDING_ATTENTION not in types:
        return {}
    return dict(sliding_window=window, layer_types=types)


def family_config_fields(gguf_arch: str, arch: str, metadata: dict[str, Any], *, layers: int,
                         hidden: int, heads: int, head_dim: int,
                         read_tensor: Callable[[str], Optional[list[float]]]
                         ) -> dict[str, Any]:
    """Gemma / Phi-3 ModelConfig fields from their GGUF keys (empty for other families).

    ``read_tensor(name)`` returns a small float tensor's values (None when absent)."""
    def key(name: str, default: Any = None) -> Any:
        return metadata.get(f"{gguf_arch}.{name}", default)

    fields: dict[str, Any] = {}
    if arch in ("gemma2", "gemma3"):
        fields.update(_sliding_fields(gguf_arch, metadata, layers))
        big = layers == _GEMMA_27B_LAYERS[arch]
        fields.update(hidden_act="gelu_pytorch_tanh",
                      query_pre_attn_scalar=float(hidden // heads if big else head_dim),
                      final_logit_softcapping=key("final_logit_softcapping"))
        if arch == "gemma2":
            fields["attn_logit_softcapping"] = key("attn_logit_softcapping")
        else:
            fields["local_rope_theta"] = float(key("rope.freq_base_swa", 10000.0))
    elif arch == "phi3":
        long, short = read_tensor(CONFIG_TENSORS[0]), read_tensor(CONFIG_TENSORS[1])
        if long is not None and short is not None:
            original = int(key("rope.scaling.original_context_length", key("context_length")))
            fields["rope_scaling"] = {
                "rope_type": "longrope", "long_factor": long, "short_factor": short,
                "original_max_position_embeddings": original,
                "factor": float(key("context_length")) / original,
                "attention_factor": key("rope.scaling.attn_factor")}
    return {k: v for k, v in fields.items() if v is not None}


def norm_offset(arch: str, hf_name: str) -> float:
    """What llama.cpp's converter added to a tensor (Gemma norms: 1), to subtract at load."""
    return 1.0 if arch in ("gemma2", "gemma3") and hf_name.endswith("norm.weight") else 0.0


def hf_names(arch: str, gguf_name: str, num_experts: int = 0) -> list[str]:
    """The HF name(s) of a llama.cpp tensor: one, or one per expert for a 3-D expert tensor;
    none for a tensor that only configures (``CONFIG_TENSORS``).

    Raises:
        ValueError: a tensor this loader does not know.
    """
    stem, _, kind = gguf_name.rpartition(".")
    if kind not in ("weight", "bias"):
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
    if gguf_name in CONFIG_TENSORS and arch == "phi3":
        return []
    if stem in GLOBAL_NAMES:
        return [f"{GLOBAL_NAMES[stem]}.{kind}"]
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit():
        prefix, sub = f"model.layers.{int(parts[1])}.", parts[2]
        if arch in ("gemma2", "gemma3") and sub in _GEMMA_LAYER_NAMES:
            return [f"{prefix}{_GEMMA_LAYER_NAMES[sub]}.{kind}"]
        if arch == "phi3" and sub in _PHI3_LAYER_NAMES:
            return [f"{prefix}{_PHI3_LAYER_NAMES[sub]}.{kind}"]
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
