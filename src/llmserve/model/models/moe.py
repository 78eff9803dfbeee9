"""Mixture-of-experts decoders: Mixtral, Qwen2-MoE, Qwen3-MoE.

Attention is the Llama family's (Qwen2-MoE: q/k/v bias; Qwen3-MoE: q/k norm; Mixtral: an
optional sliding window); the MLP of a sparse layer is a :class:`MoEMLP`. Differences::

    mixtral     8 experts of intermediate_size, top-2, weights renormalised to sum 1;
                checkpoint names block_sparse_moe.gate / experts.{e}.w1 (gate) w3 (up) w2 (down)
    qwen2_moe   experts of moe_intermediate_size, top-k, renormalised if norm_topk_prob,
                plus a shared expert (shared_expert_intermediate_size) scaled by
                sigmoid(shared_expert_gate(x)); layers in mlp_only_layers or off the
                decoder_sparse_step pattern have a dense MLP of intermediate_size
    qwen3_moe   as qwen2_moe without the shared expert

The compiled decode step cannot trace the grouping by expert (its sizes depend on the
routing), so these models decode eagerly (the runner logs why).
"""
from __future__ import annotations

import re

import torch
from torch import nn

from llmserve.model.attention.backend import AttentionBackend
from llmserve.model.config import ModelConfig
from llmserve.model.layers.linear import LinearMethod
from llmserve.model.layers.moe import MoEMLP
from llmserve.model.layers.norm import RMSNorm
from llmserve.model.models.base import (
    SPLIT_QKV_GATE_UP,
    CausalLM,
    DecoderAttention,
    DecoderLayer,
    GatedMLP,
    Shapes,
    attention_shapes,
    gated_mlp_shapes,
)

# checkpoint sub-path patterns -> (module path template, shard)
_EXPERT_NAMES = [
    (re.compile(r"block_sparse_moe\.experts\.(\d+)\.w1"), "mlp.experts.{}.gate_up_proj", 0),
    (re.compile(r"block_sparse_moe\.experts\.(\d+)\.w3"), "mlp.experts.{}.gate_up_proj", 1),
    (re.compile(r"block_sparse_moe\.experts\.(\d+)\.w2"), "mlp.experts.{}.down_proj", None),
    (re.compile(r"mlp\.experts\.(\d+)\.gate_proj"), "mlp.experts.{}.gate_up_proj", 0),
    (re.compile(r"mlp\.experts\.(\d+)\.up_proj"), "mlp.experts.{}.gate_up_proj", 1),
]
_OTHER_NAMES = {
    "block_sparse_moe.gate": ("mlp.gate", None),
    "mlp.shared_expert.gate_proj": ("mlp.shared_expert.gate_up_proj", 0),
    "mlp.shared_expert.up_proj": ("mlp.shared_expert.gate_up_proj", 1),
}


def _expert_size(cfg: ModelConfig) -> int:
    return cfg.moe_intermediate_size or cfg.intermediate_size


class MoEForCausalLM(CausalLM):
    """Mixtral / Qwen2-MoE / Qwen3-MoE: Llama attention, mixture-of-experts MLPs."""

    compile_unsupported = ("mixture-of-experts layers group tokens by expert with "
                           "routing-dependent sizes, which the compiled decode graph cannot trace")

    def make_layer(self, cfg: ModelConfig, layer: int, backend: AttentionBackend,
                   method: LinearMethod, dtype: torch.dtype, device: torch.device) -> nn.Module:
        if cfg.num_experts < 1:
            raise ValueError(f"{cfg.architecture} needs num_experts >= 1")
        attn = DecoderAttention(cfg, layer, backend, method, dtype, device)
        h = cfg.hidden_size
        if not cfg.is_sparse_layer(layer):
            mlp = GatedMLP(h, cfg.intermediate_size, cfg.hidden_act, method, dtype, device)
        else:
            size = _expert_size(cfg)
            shared = None
            if cfg.shared_expert_intermediate_size:
                shared = GatedMLP(h, cfg.shared_expert_intermediate_size, cfg.hidden_act,
                                  method, dtype, device)
            mlp = MoEMLP(h, cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob,
                         lambda: GatedMLP(h, size, cfg.hidden_act, method, dtype, device),
                         dtype, device, shared_expert=shared)
        return DecoderLayer(cfg, attn, mlp, RMSNorm, dtype, device)

    def rename(self, sub: str) -> tuple[str, "int | None"]:
        for pattern, target, shard in _EXPERT_NAMES:
            match = pattern.fullmatch(sub)
            if match:
                return target.format(match.group(1)), shard
        if sub in _OTHER_NAMES:
            return _OTHER_NAMES[sub]
        return SPLIT_QKV_GATE_UP.get(sub, (sub, None))

    @classmethod
    def layer_weight_shapes(cls, cfg: ModelConfig, layer: int, prefix: str) -> Shapes:
        h = cfg.hidden_size
        shapes = {prefix + "input_layernorm.weight": (h,),
                  prefix + "post_attention_layernorm.weight": (h,)}
        shapes.update(attention_shapes(cfg, prefix))
        if not cfg.is_sparse_layer(layer):
            shapes.update(gated_mlp_shapes(prefix + "mlp.", h, cfg.intermediate_size))
            return shapes
        size, e = _expert_size(cfg), cfg.num_experts
        if cfg.architecture == "mixtral":
            p = prefix + "block_sparse_moe."
            shapes[p + "gate.weight"] = (e, h)
            for i in range(e):
                q = f"{p}experts.{i}."
                shapes.update({q + "w1.weight": (size, h), q + "w3.weight": (size, h),
                               q + "w2.weight": (h, size)})
            return shapes
        p = prefix + "mlp."
        shapes[p + "gate.weight"] = (e, h)
        for i in range(e):
            shapes.update(gated_mlp_shapes(f"{p}experts.{i}.", h, size))
        if cfg.shared_expert_intermediate_size:
            shapes.update(gated_mlp_shapes(p + "shared_expert.", h,
                                           cfg.shared_expert_intermediate_size))
            shapes[p + "shared_expert_gate.weight"] = (1, h)
        return shapes
