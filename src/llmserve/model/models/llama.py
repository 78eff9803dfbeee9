"""The Llama family (Llama 2/3, Mistral, Qwen2, Qwen3) as ``nn.Module`` layers.

Family differences are flags on ModelConfig: ``attention_bias`` (Qwen2's q/k/v bias; Llama's
covers o_proj too) and ``qk_norm`` (Qwen3's per-head RMSNorm on q and k). Projections are
fused (q/k/v into ``qkv_proj``, gate/up into ``gate_up_proj``), each a :class:`Linear` whose
``LinearMethod`` owns the weight format; checkpoint tensors arrive one at a time through
:meth:`LlamaForCausalLM.load_weights` and land in their fused slot.
"""
from __future__ import annotations

import logging
from typing import Iterable, Optional

import torch
from torch import nn

from llmserve.model.attention.backend import AttentionBackend, AttentionMetadata
from llmserve.model.config import ModelConfig
from llmserve.model.layers.embedding import LMHead, VocabEmbedding
from llmserve.model.layers.linear import Linear, LinearMethod
from llmserve.model.layers.norm import RMSNorm, silu_and_mul
from llmserve.model.layers.rotary import RotaryEmbedding

logger = logging.getLogger(__name__)

KVCache = tuple[torch.Tensor, torch.Tensor]

# checkpoint sub-name -> (module attribute, shard index in the fused layer)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, method: LinearMethod,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        h, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, hkv, d
        self.qkv_proj = Linear(cfg.hidden_size, [h * d, hkv * d, hkv * d],
                               bias=cfg.attention_bias, method=method, dtype=dtype, device=device)
        o_bias = cfg.attention_bias and cfg.architecture == "llama"
        self.o_proj = Linear(h * d, cfg.hidden_size, bias=o_bias, method=method, dtype=dtype,
                             device=device)
        self.q_norm = self.k_norm = None
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dtype, device)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dtype, device)
        self.split = [h * d, hkv * d, hkv * d]
        self.scale = d ** -0.5
        self.backend = backend

    def forward(self, positions: torch.Tensor, x: torch.Tensor, rotary: RotaryEmbedding,
                kv: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.split, -1)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(positions, q, k)
        out = self.backend.forward(q, k, v, kv[0], kv[1], meta, self.scale)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, method: LinearMethod, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        if cfg.hidden_act != "silu":
            raise ValueError(f"hidden_act {cfg.hidden_act!r} is not supported (only silu)")
        i = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, [i, i], bias=False, method=method,
                                   dtype=dtype, device=device)
        self.down_proj = Linear(i, cfg.hidden_size, bias=False, method=method, dtype=dtype,
                                device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, method: LinearMethod,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.self_attn = LlamaAttention(cfg, backend, method, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.mlp = LlamaMLP(cfg, method, dtype, device)

    def forward(self, positions: torch.Tensor, h: torch.Tensor, rotary: RotaryEmbedding,
                kv: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        h = h + self.self_attn(positions, self.input_layernorm(h), rotary, kv, meta)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaForCausalLM(nn.Module):
    """Embedding -> decoder layers -> final norm -> LM head, over a paged KV cache."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, method: LinearMethod,
                 dtype: torch.dtype, device: torch.device, max_positions: int) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype, device)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, backend, method, dtype, device)
            for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size,
                              tied_to=self.embed_tokens if cfg.tie_word_embeddings else None,
                              method=method, dtype=dtype, device=device)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta,
                                      cfg.rope_scaling, device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states ``(T, hidden)`` of the new tokens, before the final norm."""
        h = self.embed_tokens(input_ids)
        for layer, kv in zip(self.layers, kv_caches):
            h = layer(positions, h, self.rotary, kv, meta)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``(N, vocab)`` of selected hidden rows."""
        return self.lm_head(self.norm(hidden))

    # ---- loading ------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named checkpoint tensors one at a time into their (fused) parameters."""
        loaded: set[str] = set()
        for name, tensor in weights:
            target, param, shard = self._route(name)
            if target is None:
                continue
            target.load(param, tensor, shard)
            loaded.add(name)
            del tensor
        for module in self.modules():
            if isinstance(module, Linear):
                module.finish_loading()
        self.lm_head.finish_loading()
        logger.debug("loaded %d tensors", len(loaded))

    def _route(self, name: str) -> tuple[Optional[nn.Module], str, Optional[int]]:
        if name == "lm_head.weight":
            if self.lm_head.linear is None:
                return None, "", None
            return self.lm_head.linear, "weight", None
        if not name.startswith("model."):
            raise ValueError(f"unexpected checkpoint tensor {name!r}")
        path, param = name[len("model."):].rsplit(".", 1)
        shard = None
        if path.startswith("layers."):
            _, idx, sub = path.split(".", 2)
            if sub in _FUSED:
                sub, shard = _FUSED[sub]
            path = f"layers.{idx}.{sub}"
        try:
            module = self.get_submodule(path)
        except AttributeError:
            raise ValueError(f"unexpected checkpoint tensor {name!r}") from None
        return module, param, shard

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights as resident (packed linears at their packed size)."""
        total = 0
        for module in self.modules():
            if isinstance(module, (Linear, VocabEmbedding)):
                total += module.weight_bytes
            elif isinstance(module, RMSNorm):
                total += sum(p.numel() * p.element_size() for p in module.parameters(False))
        return total + self.lm_head.extra_bytes - (
            self.lm_head.linear.weight_bytes if self.lm_head.linear is not None else 0)
