"""The decoder-only transformer (Llama / Mistral / Qwen2 / Qwen3 family) over a paged KV cache.

Weights are plain tensors held per layer; Q/K/V and gate/up projections are fused into
one matrix each so a layer is 4 GEMMs. Family differences are flags on ModelConfig
(`attention_bias` for Qwen2, `qk_norm` for Qwen3).
"""
from __future__ import annotations

import logging
from typing import Mapping

import torch
import torch.nn.functional as F

from llmserve.model.attention import AttentionMetadata, paged_attention
from llmserve.model.config import ModelConfig
from llmserve.model.rotary import (
    RotaryEmbedding, apply_rotary, interleave_norm_weight, to_interleaved_rows,
)

logger = logging.getLogger(__name__)


class DecoderLayer:
    """One transformer block's weights and forward."""

    def __init__(self, cfg: ModelConfig, w: Mapping[str, torch.Tensor], prefix: str,
                 dtype: torch.dtype, device: torch.device) -> None:
        H, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = H, Hkv, D
        self.hidden = cfg.hidden_size
        self.eps = cfg.rms_norm_eps

        def get(name: str) -> torch.Tensor:
            key = f"{prefix}.{name}"
            if key not in w:
                raise KeyError(f"checkpoint is missing tensor {key!r}")
            return w[key]

        def put(t: torch.Tensor) -> torch.Tensor:
            return t.to(device=device, dtype=dtype).contiguous()

        q = to_interleaved_rows(get("self_attn.q_proj.weight"), H)
        k = to_interleaved_rows(get("self_attn.k_proj.weight"), Hkv)
        v = get("self_attn.v_proj.weight")
        self.qkv_w = put(torch.cat([q, k, v], 0))
        self.qkv_b = None
        if cfg.attention_bias:
            qb = to_interleaved_rows(get("self_attn.q_proj.bias"), H)
            kb = to_interleaved_rows(get("self_attn.k_proj.bias"), Hkv)
            self.qkv_b = put(torch.cat([qb, kb, get("self_attn.v_proj.bias")], 0))
        self.q_norm_w = self.k_norm_w = None
        if cfg.qk_norm:
            self.q_norm_w = put(interleave_norm_weight(get("self_attn.q_norm.weight")))
            self.k_norm_w = put(interleave_norm_weight(get("self_attn.k_norm.weight")))
        self.o_w = put(get("self_attn.o_proj.weight"))
        o_bias = w.get(f"{prefix}.self_attn.o_proj.bias")  # Llama with attention_bias
        self.o_b = put(o_bias) if o_bias is not None else None
        self.gate_up_w = put(torch.cat([get("mlp.gate_proj.weight"), get("mlp.up_proj.weight")], 0))
        self.down_w = put(get("mlp.down_proj.weight"))
        self.in_norm_w = put(get("input_layernorm.weight"))
        self.post_norm_w = put(get("post_attention_layernorm.weight"))
        self.split = [H * D, Hkv * D, Hkv * D]
        self.scale = D ** -0.5

    def forward(self, h: torch.Tensor, cis: torch.Tensor, meta: AttentionMetadata,
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        T = h.shape[0]
        x = F.rms_norm(h, (self.hidden,), self.in_norm_w, self.eps)
        q, k, v = F.linear(x, self.qkv_w, self.qkv_b).split(self.split, -1)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if self.q_norm_w is not None:
            q = F.rms_norm(q, (self.head_dim,), self.q_norm_w, self.eps)
            k = F.rms_norm(k, (self.head_dim,), self.k_norm_w, self.eps)
        q = apply_rotary(q, cis)
        k = apply_rotary(k, cis)
        attn = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale)
        h = h + F.linear(attn, self.o_w, self.o_b)
        x = F.rms_norm(h, (self.hidden,), self.post_norm_w, self.eps)
        gate, up = F.linear(x, self.gate_up_w).chunk(2, -1)
        return h + F.linear(F.silu(gate) * up, self.down_w)


class DecoderModel:
    """Embedding -> N DecoderLayers -> final norm -> LM head."""

    def __init__(self, cfg: ModelConfig, weights: Mapping[str, torch.Tensor],
                 dtype: torch.dtype, device: torch.device, max_positions: int) -> None:
        self.config = cfg
        self.dtype = dtype
        self.device = device
        if "model.embed_tokens.weight" not in weights:
            raise KeyError("checkpoint is missing tensor 'model.embed_tokens.weight'")
        self.embed = weights["model.embed_tokens.weight"].to(device=device, dtype=dtype).contiguous()
        if cfg.tie_word_embeddings or "lm_head.weight" not in weights:
            self.lm_head = self.embed
        else:
            self.lm_head = weights["lm_head.weight"].to(device=device, dtype=dtype).contiguous()
        self.norm_w = weights["model.norm.weight"].to(device=device, dtype=dtype)
        self.layers = [
            DecoderLayer(cfg, weights, f"model.layers.{i}", dtype, device)
            for i in range(cfg.num_hidden_layers)
        ]
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta,
                                      cfg.rope_scaling, device)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
                ) -> torch.Tensor:
        """Hidden states (T, hidden) of the new tokens, before the final norm."""
        h = F.embedding(input_ids, self.embed)
        cis = self.rotary.for_positions(positions)
        for layer, (kc, vc) in zip(self.layers, kv_caches):
            h = layer.forward(h, cis, meta, kc, vc)
        return h

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits (N, vocab) for selected hidden rows."""
        x = F.rms_norm(hidden, (self.config.hidden_size,), self.norm_w, self.config.rms_norm_eps)
        return F.linear(x, self.lm_head).float()
