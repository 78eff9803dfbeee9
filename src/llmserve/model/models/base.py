"""Building blocks every decoder family shares, and the causal-LM shell around them.

A family file (llama.py, gemma.py, phi3.py, moe.py) subclasses :class:`CausalLM` and says
only what differs: which norm, how a layer is wired, which MLP, how checkpoint names map to
modules. The shell owns the rest::

    ids -> embedding (x embed_scale) -> layer_0 .. layer_{L-1} -> final norm -> LM head
                                                                      (-> logit soft-cap)

Projections are :class:`Linear` layers, so the ``LinearMethod`` the runner picked (dense,
int8, int4, GGUF-packed) owns every weight; q/k/v and gate/up are fused (``qkv_proj``,
``gate_up_proj``) and the checkpoint's separate tensors land in their shard. Checkpoint
tensors arrive one at a time through :meth:`CausalLM.load_weights`.
"""
from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import Iterable, Optional

import torch
from torch import nn

from llmserve.model.attention.backend import AttentionBackend, AttentionMetadata
from llmserve.model.config import ModelConfig
from llmserve.model.layers.activation import GatedActivation, gated_activation, native_silu_mul
from llmserve.model.layers.compiled_rows import WARMUP_ROWS, compile_rows, many_rows
from llmserve.model.layers.embedding import LMHead, VocabEmbedding
from llmserve.model.layers.linear import ATTENTION_INPUT, Linear, LinearMethod
from llmserve.model.layers.norm import RMSNorm
from llmserve.model.layers.rotary import RotaryEmbedding

logger = logging.getLogger(__name__)

KVCache = tuple[torch.Tensor, torch.Tensor]
Shapes = dict[str, tuple[int, ...]]

#: checkpoint sub-name -> (module path, shard index in the fused layer)
SPLIT_QKV_GATE_UP = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


class DecoderAttention(nn.Module):
    """Fused-qkv attention with optional q/k norm, sliding window and score soft-capping."""

    def __init__(self, cfg: ModelConfig, layer: int, backend: AttentionBackend,
                 method: LinearMethod, dtype: torch.dtype, device: torch.device, *,
                 norm_cls: type = RMSNorm, o_bias: bool = False) -> None:
        super().__init__()
        h, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, hkv, d
        self.split = [h * d, hkv * d, hkv * d]
        self.qkv_proj = Linear(cfg.hidden_size, self.split, bias=cfg.attention_bias,
                               method=method, dtype=dtype, device=device, role=ATTENTION_INPUT)
        self.o_proj = Linear(h * d, cfg.hidden_size, bias=o_bias, method=method, dtype=dtype,
                             device=device)
        self.q_norm = self.k_norm = None
        if cfg.qk_norm:
            self.q_norm = norm_cls(d, cfg.rms_norm_eps, dtype, device)
            self.k_norm = norm_cls(d, cfg.rms_norm_eps, dtype, device)
        pre = cfg.query_pre_attn_scalar
        self.scale = (pre if pre is not None else d) ** -0.5
        self.window = cfg.layer_window(layer)
        self.softcap = cfg.attn_logit_softcapping
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
        out = self.backend.forward(q, k, v, kv[0], kv[1], meta, self.scale, self.window,
                                   self.softcap)
        return self.o_proj(out)


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with gate/up fused into ``gate_up_proj``."""

    def __init__(self, hidden: int, intermediate: int, act: str, method: LinearMethod,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.act = gated_activation(act, dtype, device)
        self.gate_up_proj = Linear(hidden, [intermediate, intermediate], bias=False,
                                   method=method, dtype=dtype, device=device)
        self.down_proj = Linear(intermediate, hidden, bias=False, method=method, dtype=dtype,
                                device=device)
        self.intermediate = intermediate
        self.rows_act: Optional[GatedActivation] = None

    def compile_rows(self, dtype: torch.dtype, device: torch.device) -> bool:
        """Take the compiled many-row activation (layers/compiled_rows.py); the native
        kernel needs none (it is the function of every path already)."""
        if self.act is native_silu_mul:
            return False
        gate_up = torch.zeros(WARMUP_ROWS, 2 * self.intermediate, dtype=dtype,
                              device=device)
        self.rows_act = compile_rows(self.act, gate_up)
        return self.rows_act is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        act = self.rows_act if self.rows_act is not None and gate_up.dim() == 2 and \
            many_rows(gate_up.shape[0]) else self.act
        return self.down_proj(act(gate_up))


class DecoderLayer(nn.Module):
    """Pre-norm residual block; ``sandwich`` adds Gemma's norms after attention and MLP::

        plain:     h += attn(in_norm(h));            h += mlp(post_attn_norm(h))
        sandwich:  h += post_attn_norm(attn(in_norm(h)));  h += post_ff_norm(mlp(pre_ff_norm(h)))
    """

    def __init__(self, cfg: ModelConfig, attn: nn.Module, mlp: nn.Module, norm_cls: type,
                 dtype: torch.dtype, device: torch.device, sandwich: bool = False) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = norm_cls(h, eps, dtype, device)
        self.self_attn = attn
        self.post_attention_layernorm = norm_cls(h, eps, dtype, device)
        self.mlp = mlp
        self.sandwich = sandwich
        if sandwich:
            self.pre_feedforward_layernorm = norm_cls(h, eps, dtype, device)
            self.post_feedforward_layernorm = norm_cls(h, eps, dtype, device)

    def forward(self, positions: torch.Tensor, h: torch.Tensor, rotary: RotaryEmbedding,
                kv: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        a = self.self_attn(positions, self.input_layernorm(h), rotary, kv, meta)
        if not self.sandwich:
            h = h + a
            return h + self.mlp(self.post_attention_layernorm(h))
        h = h + self.post_attention_layernorm(a)
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


def attention_shapes(cfg: ModelConfig, prefix: str, o_bias: bool = False) -> Shapes:
    """Checkpoint shapes of one layer's q/k/v/o projections (+ biases, q/k norms)."""
    h, d = cfg.hidden_size, cfg.head_dim
    q_rows, kv_rows = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    p = prefix + "self_attn."
    shapes: Shapes = {p + "q_proj.weight": (q_rows, h), p + "k_proj.weight": (kv_rows, h),
                      p + "v_proj.weight": (kv_rows, h), p + "o_proj.weight": (h, q_rows)}
    if cfg.attention_bias:
        shapes.update({p + "q_proj.bias": (q_rows,), p + "k_proj.bias": (kv_rows,),
                       p + "v_proj.bias": (kv_rows,)})
    if o_bias:
        shapes[p + "o_proj.bias"] = (h,)
    if cfg.qk_norm:
        shapes.update({p + "q_norm.weight": (d,), p + "k_norm.weight": (d,)})
    return shapes


def gated_mlp_shapes(prefix: str, hidden: int, intermediate: int) -> Shapes:
    """Checkpoint shapes of a gate/up/down MLP under ``prefix`` (e.g. ``...layers.0.mlp.``)."""
    return {prefix + "gate_proj.weight": (intermediate, hidden),
            prefix + "up_proj.weight": (intermediate, hidden),
            prefix + "down_proj.weight": (hidden, intermediate)}


class CausalLM(nn.Module, ABC):
    """Embedding -> decoder layers -> final norm -> LM head, over a paged KV cache.

    Subclasses implement :meth:`make_layer` and :meth:`layer_weight_shapes`, and may set:
    ``norm_cls`` (RMSNorm flavour), ``renames`` (checkpoint sub-name -> module path, shard),
    ``embed_scale_by_sqrt_hidden`` (Gemma), ``compile_unsupported`` (a reason to run the
    decode step eagerly).
    """

    norm_cls: type = RMSNorm
    renames: dict[str, tuple[str, Optional[int]]] = SPLIT_QKV_GATE_UP
    embed_scale_by_sqrt_hidden = False
    #: None: the compiled decode step can trace this model; else why it cannot.
    compile_unsupported: Optional[str] = None

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, method: LinearMethod,
                 dtype: torch.dtype, device: torch.device, max_positions: int) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype, device,
                                           block_table=method.gguf_block_tables)
        self.embed_scale = None
        if self.embed_scale_by_sqrt_hidden:   # rounded to the model dtype, as transformers does
            self.embed_scale = float(torch.tensor(cfg.hidden_size ** 0.5, dtype=dtype))
        self.layers = nn.ModuleList(self.make_layer(cfg, i, backend, method, dtype, device)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = self.norm_cls(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size,
                              tied_to=self.embed_tokens if cfg.tie_word_embeddings else None,
                              method=method, dtype=dtype, device=device)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta,
                                      cfg.rope_scaling, device)
        self._layer_rotary = [self.rotary] * cfg.num_hidden_layers
        if cfg.local_rope_theta is not None:   # sliding layers rotate with their own base
            self.local_rotary = RotaryEmbedding(cfg.head_dim, max_positions,
                                                cfg.local_rope_theta, None, device)
            self._layer_rotary = [self.local_rotary if cfg.layer_window(i) else self.rotary
                                  for i in range(cfg.num_hidden_layers)]

    # ---- what a family defines ----------------------------------------------------------
    @abstractmethod
    def make_layer(self, cfg: ModelConfig, layer: int, backend: AttentionBackend,
                   method: LinearMethod, dtype: torch.dtype, device: torch.device) -> nn.Module:
        """Layer ``layer``: a :class:`DecoderLayer` with this family's attention and MLP."""

    @classmethod
    @abstractmethod
    def layer_weight_shapes(cls, cfg: ModelConfig, layer: int, prefix: str) -> Shapes:
        """Checkpoint tensors of layer ``layer`` (names start with ``prefix``) and shapes."""

    @classmethod
    def expected_weight_shapes(cls, cfg: ModelConfig) -> Shapes:
        """Every tensor a checkpoint for ``cfg`` must provide, with its shape (HF names)."""
        h = cfg.hidden_size
        shapes: Shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h),
                          "model.norm.weight": (h,)}
        if not cfg.tie_word_embeddings:
            shapes["lm_head.weight"] = (cfg.vocab_size, h)
        for i in range(cfg.num_hidden_layers):
            shapes.update(cls.layer_weight_shapes(cfg, i, f"model.layers.{i}."))
        return shapes

    # ---- forward ------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states ``(T, hidden)`` of the new tokens, before the final norm."""
        h = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            h = h * self.embed_scale
        # layers indexed, not iterated: iterating a ModuleList makes a traced graph guard
        # the order of its dict's keys, a guard a saved graph cannot keep (graph_store.py)
        for i, (rotary, kv) in enumerate(zip(self._layer_rotary, kv_caches)):
            h = self.layers[i](positions, h, rotary, kv, meta)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``(N, vocab)`` of selected hidden rows (soft-capped if configured)."""
        return self.logits_of_normed(self.norm(hidden))

    def logits_of_normed(self, normed: torch.Tensor) -> torch.Tensor:
        """Logits of rows already through the final norm (see :meth:`compute_logits`)."""
        logits = self.lm_head(normed)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    # ---- loading ------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named checkpoint tensors one at a time into their (fused) parameters."""
        count = 0
        for name, tensor in weights:
            target, param, shard = self.route(name)
            if target is None:
                continue
            target.load(param, tensor, shard)
            count += 1
            del tensor
        for module in self.modules():
            if isinstance(module, Linear):
                module.finish_loading()
        self.lm_head.finish_loading()
        logger.debug("loaded %d tensors", count)

    def rename(self, sub: str) -> tuple[str, Optional[int]]:
        """A layer's checkpoint sub-path (``self_attn.q_proj``) -> (module path, shard)."""
        return self.renames.get(sub, (sub, None))

    def route(self, name: str) -> tuple[Optional[nn.Module], str, Optional[int]]:
        """``(module, parameter name, shard)`` a checkpoint tensor loads into."""
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
            sub, shard = self.rename(sub)
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

