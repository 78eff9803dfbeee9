"""Tensor-parallel shards of the Llama-family layers, through the LinearMethod seam.

Each rank builds the ordinary model from :func:`local_config` (its share of the heads and
of the MLP width), so every ``Linear`` already has its shard's shape, then
:func:`shard_model` wraps the methods and the vocabulary modules:

* **column-parallel** ``qkv_proj`` and ``gate_up_proj`` (:class:`ColumnParallelMethod`):
  a rank keeps its rows of each fused part (its q heads, its k/v heads, its slice of gate
  and of up); no communication.
* **row-parallel** ``o_proj`` and ``down_proj`` (:class:`RowParallelMethod`): a rank keeps
  its input columns, multiplies, and one all-reduce sums the partial outputs; the bias
  is added by rank 0 only.
* K/V heads: ``num_kv_heads / N`` per rank; when ``N > num_kv_heads`` each K/V head is
  replicated on ``N / num_kv_heads`` ranks (a rank's query heads always share one), so
  each rank's KV pool holds only the heads its queries read.
* **vocab-parallel** embedding and LM head (:class:`VocabParallelEmbedding`,
  :class:`ParallelLMHead`): the vocabulary is padded to a multiple of N and split in
  contiguous row ranges; the lookup zeroes foreign ids and all-reduces, the head's local
  logits are all-gathered (then cut to the real vocabulary) before sampling.

Quantized linears (int8, int4) shard too: each rank quantizes its float slice at load (a
GGUF file is then read dequantized, never as raw blocks), and int4 splits must be
group-aligned (each rank's input columns a multiple of the group size). Weights kept
packed as stored in a GGUF file (``--quantization auto`` on a quantized GGUF in bf16)
cannot be sliced and are refused with a message naming the flags to use.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import nn

from llmserve.model.config import ModelConfig
from llmserve.model.distributed.group import TensorParallelGroup
from llmserve.model.distributed.plans import TensorParallelPlan, plan_for
from llmserve.model.layers.embedding import LMHead, VocabEmbedding
from llmserve.model.layers.linear import Linear, LinearMethod


def padded_vocab(vocab_size: int, world_size: int) -> int:
    return -(-vocab_size // world_size) * world_size


def check_shardable(cfg: ModelConfig, world_size: int, method: LinearMethod) -> None:
    """Raise ValueError naming the family without a plan, or the first dimension (or
    format) that cannot be split."""
    n = world_size
    plan_for(cfg.architecture, n)
    h, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    if h % n:
        raise ValueError(f"--tensor-parallel-size {n} must divide num_attention_heads ({h})")
    if hkv % n and n % hkv:
        raise ValueError(f"--tensor-parallel-size {n} and num_key_value_heads ({hkv}) must "
                         "divide one another (K/V heads are split, or replicated)")
    if cfg.intermediate_size % n:
        raise ValueError(f"--tensor-parallel-size {n} must divide intermediate_size "
                         f"({cfg.intermediate_size})")
    from llmserve.model.quant.methods import GGUFLinearMethod, Int4CheckpointLinearMethod

    if isinstance(method, (GGUFLinearMethod, Int4CheckpointLinearMethod)):
        raise ValueError("tensor parallelism cannot split GGUF-, GPTQ- or AWQ-packed weights "
                         "(--quantization auto on a quantized file); use --quantization none, "
                         "int8 or int4")
    group = getattr(method, "group_size", None)
    if group:
        for name, width in (("o_proj", h * cfg.head_dim), ("down_proj", cfg.intermediate_size)):
            if (width // n) % group:
                raise ValueError(f"--quantization int4 with groups of {group} cannot split "
                                 f"{name}'s {width} input columns into {n} group-aligned "
                                 f"shards; use another --quantization-group-size or TP size")


def local_config(cfg: ModelConfig, world_size: int) -> ModelConfig:
    """One rank's share: heads, K/V heads (at least one), MLP width, padded vocab rows."""
    n = world_size
    return dataclasses.replace(
        cfg, num_attention_heads=cfg.num_attention_heads // n,
        num_key_value_heads=max(1, cfg.num_key_value_heads // n),
        intermediate_size=cfg.intermediate_size // n,
        vocab_size=padded_vocab(cfg.vocab_size, n) // n)


class ColumnParallelMethod(LinearMethod):
    """Keep this rank's output rows of each fused part; ``part_slices[shard]`` gives the
    (start, rows) of the rank's rows inside that part of the full checkpoint tensor."""

    def __init__(self, inner: LinearMethod, part_slices: list[tuple[int, int]]) -> None:
        self.inner = inner
        self.part_slices = part_slices
        self.wants_raw_gguf = inner.wants_raw_gguf

    def create_weights(self, layer: Linear, dtype: torch.dtype, device: torch.device) -> None:
        self.inner.create_weights(layer, dtype, device)

    def load_weight(self, layer: Linear, name: str, tensor: torch.Tensor,
                    shard: Optional[int]) -> None:
        start, rows = self.part_slices[shard or 0]
        self.inner.load_weight(layer, name, tensor.narrow(0, start, rows).contiguous(), shard)

    def process_weights_after_loading(self, layer: Linear) -> None:
        self.inner.process_weights_after_loading(layer)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return self.inner.apply(layer, x)

    def weight_bytes(self, layer: Linear) -> int:
        return self.inner.weight_bytes(layer)


class RowParallelMethod(LinearMethod):
    """Keep this rank's input columns; all-reduce the partial products (bias on rank 0)."""

    def __init__(self, inner: LinearMethod, group: TensorParallelGroup) -> None:
        self.inner, self.group = inner, group
        self.wants_raw_gguf = inner.wants_raw_gguf

    def create_weights(self, layer: Linear, dtype: torch.dtype, device: torch.device) -> None:
        self.inner.create_weights(layer, dtype, device)

    def load_weight(self, layer: Linear, name: str, tensor: torch.Tensor,
                    shard: Optional[int]) -> None:
        if name == "bias":
            if self.group.rank != 0:
                tensor = torch.zeros_like(tensor)
        else:
            cols = layer.input_size
            tensor = tensor.narrow(1, self.group.rank * cols, cols).contiguous()
        self.inner.load_weight(layer, name, tensor, shard)

    def process_weights_after_loading(self, layer: Linear) -> None:
        self.inner.process_weights_after_loading(layer)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(self.inner.apply(layer, x))

    def weight_bytes(self, layer: Linear) -> int:
        return self.inner.weight_bytes(layer)


def _vocab_rows(tensor: torch.Tensor, start: int, rows: int) -> torch.Tensor:
    """Rows [start, start + rows) of a (vocab, hidden) tensor, zero-padded past its end."""
    end = min(start + rows, tensor.shape[0])
    part = tensor[start:end]
    if part.shape[0] < rows:
        pad = torch.zeros(rows - part.shape[0], *tensor.shape[1:], dtype=tensor.dtype)
        part = torch.cat([part, pad])
    return part


class VocabParallelEmbedding(nn.Module):
    """The embedding rows ``[start, start + rows)`` of this rank; lookups of other ids give
    zeros, and an all-reduce assembles every token's row."""

    def __init__(self, inner: VocabEmbedding, vocab_size: int, group: TensorParallelGroup
                 ) -> None:
        super().__init__()
        self.inner, self.group, self.vocab_size = inner, group, vocab_size
        self.rows = inner.shape[0]
        self.start = group.rank * self.rows

    def load(self, name: str, tensor: torch.Tensor, shard: object = None) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise ValueError("tensor parallelism cannot split a GGUF-packed embedding; use "
                             "--quantization none, int8 or int4")
        if tuple(tensor.shape) != (self.vocab_size, self.inner.shape[1]):
            raise ValueError(f"embedding ({self.vocab_size}, {self.inner.shape[1]}) cannot load "
                             f"{name} of shape {tuple(tensor.shape)}")
        self.inner.load(name, _vocab_rows(tensor, self.start, self.rows))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        inside = (local >= 0) & (local < self.rows)
        out = self.inner(torch.where(inside, local, torch.zeros_like(local)))
        out = out * inside.unsqueeze(-1).to(out.dtype)
        return self.group.all_reduce(out)

    @property
    def weight_bytes(self) -> int:
        return 0   # counted by the inner VocabEmbedding


class _VocabRowsMethod(ColumnParallelMethod):
    """The untied LM head's rows of this rank (zero-padded past the vocabulary)."""

    def __init__(self, inner: LinearMethod, start: int, rows: int) -> None:
        super().__init__(inner, [(start, rows)])

    def load_weight(self, layer: Linear, name: str, tensor: torch.Tensor,
                    shard: Optional[int]) -> None:
        start, rows = self.part_slices[0]
        self.inner.load_weight(layer, name, _vocab_rows(tensor, start, rows), shard)


class ParallelLMHead(nn.Module):
    """This rank's logits columns, all-gathered into the full ``(N, vocab)`` logits."""

    def __init__(self, inner: LMHead, vocab_size: int, group: TensorParallelGroup) -> None:
        super().__init__()
        self.inner, self.group, self.vocab_size = inner, group, vocab_size
        if inner.linear is not None:
            rows = inner.vocab_size
            inner.linear.method = _VocabRowsMethod(inner.linear.method, group.rank * rows, rows)

    @property
    def linear(self) -> Optional[Linear]:
        return self.inner.linear

    @property
    def extra_bytes(self) -> int:
        return self.inner.extra_bytes

    def finish_loading(self, prepack: bool = True) -> None:
        self.inner.finish_loading(prepack)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_gather_last(self.inner(x))[:, :self.vocab_size]


def _qkv_slices(cfg: ModelConfig, rank: int, n: int) -> list[tuple[int, int]]:
    d, h, hkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    q_rows = h // n * d
    kv_heads = max(1, hkv // n)
    kv_start = rank * kv_heads if n <= hkv else rank // (n // hkv)
    kv = (kv_start * d, kv_heads * d)
    return [(rank * q_rows, q_rows), kv, kv]


def shard_model(model: nn.Module, cfg: ModelConfig, group: TensorParallelGroup,
                plan: TensorParallelPlan) -> None:
    """Wrap a model built from :func:`local_config` into this rank's shard (before
    ``load_weights``), as its family's ``plan`` names the projections: the full ``cfg``
    says how checkpoint tensors are cut."""
    n, rank = group.world_size, group.rank
    inter = cfg.intermediate_size // n
    for layer in model.layers:
        attn, mlp = getattr(layer, plan.attention), getattr(layer, plan.mlp)
        qkv, out = getattr(attn, plan.qkv), getattr(attn, plan.attn_out)
        gate_up, down = getattr(mlp, plan.gate_up), getattr(mlp, plan.down)
        qkv.method = ColumnParallelMethod(qkv.method, _qkv_slices(cfg, rank, n))
        out.method = RowParallelMethod(out.method, group)
        gate_up.method = ColumnParallelMethod(gate_up.method, [(rank * inter, inter)] * 2)
        down.method = RowParallelMethod(down.method, group)
    model.embed_tokens = VocabParallelEmbedding(model.embed_tokens, cfg.vocab_size, group)
    model.lm_head = ParallelLMHead(model.lm_head, cfg.vocab_size, group)
