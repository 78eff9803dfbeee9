"""The Gemma 2 and Gemma 3 decoders.

What sets them apart from Llama (all ModelConfig fields or fixed here)::

    embedding      scaled by sqrt(hidden) (rounded to the model dtype)
    norms          RMSNorm with (1 + w) weights, four per layer: input, post-attention,
                   pre-feedforward, post-feedforward ("sandwich")
    MLP            GeGLU: gelu_pytorch_tanh(gate) * up
    attention      scale 1/sqrt(query_pre_attn_scalar); alternating sliding-window (local)
                   and full (global) layers from layer_types; Gemma 2 soft-caps the scores
                   (attn_logit_softcapping) and the final logits (final_logit_softcapping);
                   Gemma 3 normalises q and k per head and rotates local layers with their
                   own base (local_rope_theta)
"""
from __future__ import annotations

import torch
from torch import nn

from llmserve.model.attention.backend import AttentionBackend
from llmserve.model.config import ModelConfig
from llmserve.model.layers.linear import LinearMethod
from llmserve.model.layers.norm import OffsetRMSNorm
from llmserve.model.models.base import (
    CausalLM,
    DecoderAttention,
    DecoderLayer,
    GatedMLP,
    Shapes,
    attention_shapes,
    gated_mlp_shapes,
)

_LAYER_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                "post_feedforward_layernorm")


class GemmaForCausalLM(CausalLM):
    """Gemma 2 / Gemma 3 (text) decoders."""

    norm_cls = OffsetRMSNorm
    embed_scale_by_sqrt_hidden = True

    def make_layer(self, cfg: ModelConfig, layer: int, backend: AttentionBackend,
                   method: LinearMethod, dtype: torch.dtype, device: torch.device) -> nn.Module:
        attn = DecoderAttention(cfg, layer, backend, method, dtype, device,
                                norm_cls=OffsetRMSNorm)
        mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, method, dtype,
                       device)
        return DecoderLayer(cfg, attn, mlp, OffsetRMSNorm, dtype, device, sandwich=True)

    @classmethod
    def layer_weight_shapes(cls, cfg: ModelConfig, layer: int, prefix: str) -> Shapes:
        h = cfg.hidden_size
        shapes: Shapes = {f"{prefix}{name}.weight": (h,) for name in _LAYER_NORMS}
        shapes.update(attention_shapes(cfg, prefix))
        shapes.update(gated_mlp_shapes(prefix + "mlp.", h, cfg.intermediate_size))
        return shapes
