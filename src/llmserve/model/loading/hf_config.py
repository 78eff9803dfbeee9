"""Read a Hugging Face ``config.json`` into a :class:`ModelConfig`, for every supported family.

Both transformers 5 (``rope_parameters``, ``layer_types`` written out) and 4.x configs
(``rope_theta`` + ``rope_scaling``, ``sliding_window_pattern``) are understood. What each
family adds on top of the Llama keys::

    mistral, mixtral, phi3   sliding_window (every layer, unless layer_types says otherwise)
    qwen2*, qwen3*           sliding_window only with use_sliding_window (layers >= max_window_layers)
    gemma2, gemma3           alternating layer_types, soft-caps, query_pre_attn_scalar,
                             gelu_pytorch_tanh; gemma3 also qk-norm and a local rope base
    mixtral, qwen*_moe       experts, top-k, expert sizes, shared expert, sparse layer pattern
    phi3                     LongRoPE (rope_type longrope/su, short/long factors)
"""
from __future__ import annotations

import json
import logging
import os
from typing import Any, Optional

from llmserve.model.config import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    SUPPORTED_ARCHITECTURES,
    ModelConfig,
    interleaved_layer_types,
)
from llmserve.model.loading.int4_checkpoint import Int4CheckpointScheme, parse_int4_scheme

logger = logging.getLogger(__name__)

#: HF model_type -> architecture, for configs without ``architectures``.
MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
               "gemma2": "gemma2", "gemma3_text": "gemma3", "phi3": "phi3",
               "mixtral": "mixtral", "qwen2_moe": "qwen2_moe", "qwen3_moe": "qwen3_moe"}
_QWEN = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
_GEMMA = ("gemma2", "gemma3")


def read_json(path: str) -> dict:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"missing {os.path.basename(path)}: {path!r} does not exist")
    with open(path, encoding="utf-8") as handle:
        try:
            return json.load(handle)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path!r} is not valid JSON: {exc}") from exc


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


def _normalise_scaling(scaling: dict) -> Optional[dict]:
    scaling = dict(scaling)
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    scaling.pop("type", None)
    if scaling.get("rope_type") == "su":
        scaling["rope_type"] = "longrope"
    partial = float(scaling.pop("partial_rotary_factor", 1.0) or 1.0)
    if partial != 1.0:
        raise ValueError(f"partial rotary embeddings (partial_rotary_factor={partial}) are "
                         "not supported")
    if scaling.get("rope_type", "default") == "default":
        return None
    return scaling


def rope_settings(cfg: dict) -> tuple[float, Optional[dict]]:
    """``(rope_theta, rope_scaling)`` from transformers 5 ``rope_parameters`` or the 4.x keys."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and FULL_ATTENTION in params:   # per layer type (Gemma 3)
        params = params[FULL_ATTENTION]
    if isinstance(params, dict) and params:
        theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(cfg.get("rope_theta", 10000.0))
        scaling = dict(cfg.get("rope_scaling") or {})
    if "partial_rotary_factor" in cfg:   # transformers 4 keeps it beside the rope keys
        scaling.setdefault("partial_rotary_factor", cfg["partial_rotary_factor"])
    scaling = _normalise_scaling(scaling)
    if scaling and scaling["rope_type"] == "longrope":
        original = scaling.get("original_max_position_embeddings",
                               cfg.get("original_max_position_embeddings"))
        if original is None:
            raise ValueError("longrope scaling needs original_max_position_embeddings")
        scaling["original_max_position_embeddings"] = int(original)
        if scaling.get("factor") is None:
            scaling["factor"] = float(cfg["max_position_embeddings"]) / int(original)
    return theta, scaling


def _local_rope_theta(cfg: dict, arch: str) -> Optional[float]:
    if arch != "gemma3":
        return None
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get(SLIDING_ATTENTION), dict):
        return float(params[SLIDING_ATTENTION].get("rope_theta", 10000.0))
    return float(cfg.get("rope_local_base_freq", 10000.0))


def _sliding(cfg: dict, arch: str, layers: int, max_len: int
             ) -> tuple[Optional[int], tuple[str, ...]]:
    """``(sliding_window, layer_types)``; (None, ()) for full attention everywhere."""
    window = cfg.get("sliding_window")
    if arch in _QWEN and not cfg.get("use_sliding_window", False):
        return None, ()
    if not window:
        return None, ()
    types = cfg.get("layer_types")
    if not types and arch in _QWEN:
        first = int(cfg.get("max_window_layers", layers))
        types = [SLIDING_ATTENTION if i >= first else FULL_ATTENTION for i in range(layers)]
    elif not types and arch in _GEMMA:
        pattern = 2 if arch == "gemma2" else int(cfg.get("sliding_window_pattern", 6))
        types = interleaved_layer_types(layers, pattern)
    types = tuple(types or ())
    if types and SLIDING_ATTENTION not in types:
        return None, ()
    if int(window) >= max_len:
        logger.info("sliding_window=%s covers the whole context; using full attention", window)
        return None, ()
    return int(window), types


def hf_architecture(cfg: dict, config_path: str) -> tuple[str, str]:
    """``(HF name, ModelConfig.architecture)``; ValueError for an unsupported one."""
    archs = cfg.get("architectures") or []
    if archs:
        name = archs[0]
        if name not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"{config_path!r}: architecture {name!r} is not supported; "
                f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        return name, SUPPORTED_ARCHITECTURES[name]
    model_type = cfg.get("model_type")
    if model_type in MODEL_TYPES:
        return str(model_type), MODEL_TYPES[model_type]
    raise ValueError(
        f"{config_path!r} names no architecture (architectures / model_type = {model_type!r}); "
        f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
    )


def _moe_fields(cfg: dict, arch: str) -> dict[str, Any]:
    if arch == "mixtral":
        return dict(num_experts=int(cfg["num_local_experts"]),
                    num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                    moe_intermediate_size=int(cfg["intermediate_size"]), norm_topk_prob=True)
    if arch in ("qwen2_moe", "qwen3_moe"):   # transformers 5 writes num_local_experts
        experts = cfg.get("num_experts") or cfg["num_local_experts"]
        return dict(num_experts=int(experts),
                    num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                    moe_intermediate_size=int(cfg["moe_intermediate_size"]),
                    shared_expert_intermediate_size=int(
                        cfg.get("shared_expert_intermediate_size") or 0)
                    if arch == "qwen2_moe" else 0,
                    norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                    decoder_sparse_step=int(cfg.get("decoder_sparse_step") or 1),
                    mlp_only_layers=tuple(int(i) for i in cfg.get("mlp_only_layers") or ()))
    return {}


def _gemma_fields(cfg: dict, arch: str) -> dict[str, Any]:
    if arch not in _GEMMA:
        return {}
    caps = {k: (float(cfg[k]) if cfg.get(k) is not None else None)
            for k in ("attn_logit_softcapping", "final_logit_softcapping")}
    if arch == "gemma3":   # Gemma 3 keeps the key but its attention never caps (as transformers)
        caps["attn_logit_softcapping"] = None
    return dict(query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)), **caps)


def int4_scheme_of(cfg: dict, config_path: str) -> "Int4CheckpointScheme | None":
    """The GPTQ/AWQ scheme of a config.json's ``quantization_config`` (None: a float
    checkpoint). Raises ValueError for any other pre-quantized format."""
    qc = cfg.get("quantization_config")
    return parse_int4_scheme(qc, repr(config_path)) if qc else None


def hf_model_config(folder: str) -> ModelConfig:
    """Read an HF folder's config.json (and generation_config.json for extra EOS ids)."""
    config_path = os.path.join(folder, "config.json")
    cfg = read_json(config_path)
    _, arch = hf_architecture(cfg, config_path)
    scheme = int4_scheme_of(cfg, config_path)
    if cfg.get("mlp_bias"):
        raise ValueError(f"{config_path!r}: mlp_bias=true is not supported")
    try:
        hidden, num_heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        max_len = int(cfg["max_position_embeddings"])
        intermediate, layers = int(cfg["intermediate_size"]), int(cfg["num_hidden_layers"])
        vocab_size = int(cfg["vocab_size"])
        moe = _moe_fields(cfg, arch)
        theta, scaling = rope_settings(cfg)
    except KeyError as exc:
        raise ValueError(f"{config_path!r} lacks required key {exc.args[0]!r}") from None
    except ValueError as exc:
        raise ValueError(f"{config_path!r}: {exc}") from None
    window, layer_types = _sliding(cfg, arch, layers, max_len)
    gen_path = os.path.join(folder, "generation_config.json")
    gen = read_json(gen_path) if os.path.isfile(gen_path) else {}
    eos = _as_id_list(cfg.get("eos_token_id")) + _as_id_list(gen.get("eos_token_id"))
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
    return ModelConfig(
        architecture=arch,
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=num_heads,
        num_key_value_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=int(cfg.get("head_dim") or hidden // num_heads),
        max_position_embeddings=max_len,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", arch in _GEMMA)),
        attention_bias=True if arch in ("qwen2", "qwen2_moe")
        else bool(cfg.get("attention_bias", False)),
        qk_norm=arch in ("qwen3", "qwen3_moe", "gemma3"),
        hidden_act=str(act),
        torch_dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(eos)),
        source_format="hf",
        quantization=scheme.name if scheme else None,
        sliding_window=window,
        layer_types=layer_types,
        local_rope_theta=_local_rope_theta(cfg, arch),
        **_gemma_fields(cfg, arch),
        **moe,
    )
