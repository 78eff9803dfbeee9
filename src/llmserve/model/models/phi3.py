"""The Phi-3 family (Phi-3, Phi-3.5, Phi-4 with full rotary): a Llama-shaped decoder whose
checkpoint stores the projections already fused.

``self_attn.qkv_proj`` (q rows, then k, then v) and ``mlp.gate_up_proj`` (gate rows, then
up) load whole into the fused :class:`Linear` layers (``shard`` None), so every
``LinearMethod`` packs them as one matrix. LongRoPE (``rope_type`` longrope / su) is handled
by the rotary table (layers/rotary.py: the short or long factor set, fixed per engine by its
context length, and the attention factor on cos/sin). ``sliding_window`` (Phi-3-mini: 2047)
applies to every layer, as in transformers.
"""
from __future__ import annotations

import torch
from torch import nn

from llmserve.model.attention.backend import AttentionBackend
from llmserve.model.config import ModelConfig
from llmserve.model.layers.linear import LinearMethod
from llmserve.model.layers.norm import RMSNorm
from llmserve.model.models.base import CausalLM, DecoderAttention, DecoderLayer, GatedMLP, Shapes


class Phi3ForCausalLM(CausalLM):
    """Phi-3: pre-norm, SwiGLU, rotary (LongRoPE), fused qkv and gate_up in the checkpoint."""

    renames: dict = {}   # checkpoint names are the module names: no per-shard tensors

    def make_layer(self, cfg: ModelConfig, layer: int, backend: AttentionBackend,
                   method: LinearMethod, dtype: torch.dtype, device: torch.device) -> nn.Module:
        attn = DecoderAttention(cfg, layer, backend, method, dtype, device)
        mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, method, dtype,
                       device)
        return DecoderLayer(cfg, attn, mlp, RMSNorm, dtype, device)

    @classmethod
    def layer_weight_shapes(cls, cfg: ModelConfig, layer: int, prefix: str) -> Shapes:
        h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
        q_rows, kv_rows = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
        return {prefix + "input_layernorm.weight": (h,),
                prefix + "post_attention_layernorm.weight": (h,),
                prefix + "self_attn.qkv_proj.weight": (q_rows + 2 * kv_rows, h),
                prefix + "self_attn.o_proj.weight": (h, q_rows),
                prefix + "mlp.gate_up_proj.weight": (2 * i, h),
                prefix + "mlp.down_proj.weight": (h, i)}
