"""The Llama family: Llama 2/3, Mistral (sliding window), Qwen2, Qwen3.

Family differences are ModelConfig fields: ``attention_bias`` (Qwen2's q/k/v bias; Llama's
covers o_proj too), ``qk_norm`` (Qwen3's per-head RMSNorm on q and k) and ``sliding_window``
(Mistral: every layer attends to its last ``sliding_window`` positions). The checkpoint's
q/k/v and gate/up tensors land in the fused ``qkv_proj`` / ``gate_up_proj`` shards.
"""
from __future__ import annotations

import torch
from torch import nn

from llmserve.model.attention.backend import AttentionBackend
from llmserve.model.config import ModelConfig
from llmserve.model.layers.linear import LinearMethod
from llmserve.model.layers.norm import RMSNorm
from llmserve.model.models.base import (
    CausalLM,
    DecoderAttention,
    DecoderLayer,
    GatedMLP,
    Shapes,
    attention_shapes,
    gated_mlp_shapes,
)


def _o_bias(cfg: ModelConfig) -> bool:
    return cfg.attention_bias and cfg.architecture == "llama"


class LlamaForCausalLM(CausalLM):
    """Llama, Mistral, Qwen2 and Qwen3 decoders (pre-norm, SwiGLU, rotary)."""

    def make_layer(self, cfg: ModelConfig, layer: int, backend: AttentionBackend,
                   method: LinearMethod, dtype: torch.dtype, device: torch.device) -> nn.Module:
        attn = DecoderAttention(cfg, layer, backend, method, dtype, device, o_bias=_o_bias(cfg))
        mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, method, dtype,
                       device)
        return DecoderLayer(cfg, attn, mlp, RMSNorm, dtype, device)

    @classmethod
    def layer_weight_shapes(cls, cfg: ModelConfig, layer: int, prefix: str) -> Shapes:
        h = cfg.hidden_size
        shapes = {prefix + "input_layernorm.weight": (h,),
                  prefix + "post_attention_layernorm.weight": (h,)}
        shapes.update(attention_shapes(cfg, prefix, o_bias=_o_bias(cfg)))
        shapes.update(gated_mlp_shapes(prefix + "mlp.", h, cfg.intermediate_size))
        return shapes
