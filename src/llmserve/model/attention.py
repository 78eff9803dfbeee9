"""Paged attention in plain PyTorch: write new K/V through a slot mapping, gather each
sequence's keys through its block table, then one SDPA call per group.

The flat token batch of a step is laid out decodes first, then prefill chunks::

    tokens:  [d0 d1 ... d_{B-1} | p0 p0 p0 p0 | p1 p1 | ... ]
              one query each      chunk of seq 0, seq 1 ...

    decode group : q (Bd, Hkv, G, D) vs keys (Bd, Hkv, Ld, D), mask key < ctx_len
    prefill group: q padded to (Bp, H, Qmax, D) vs keys (Bp, Hkv, Lp, D),
                   mask key <= query position (causal over cached + new tokens)

Decodes and prefills are each split into groups of similar block-table width (powers of
two), so one long context does not pad every short one. All index tensors are built once
per step (AttentionMetadata) and reused by every layer.
KV cache per layer: (num_blocks * block_size, num_kv_heads, head_dim); slot = block * bs + offset.
Keys are gathered a whole block at a time (one index_select of contiguous rows of
block_size * kv_heads * head_dim elements), which streams at memory speed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F


@dataclass
class GroupMetadata:
    """Index tensors of one attention group: a run of decodes, or of prefill chunks.

    Sequences are grouped by block-table width (and chunk length) in powers of two, so
    padding stays under 2x whatever mix of long and short contexts a step holds.
    """

    token_start: int               # the group's first row in the flat token batch
    num_tokens: int                # its rows (decode: one per sequence)
    block_ids: torch.Tensor        # (B, W) long: each sequence's block table (padding -> block 0)
    mask: torch.Tensor             # (B, 1, Q, W * block_size) bool
    query_index: Optional[torch.Tensor] = None  # prefill: (B*Qmax,) group row per padded query
    output_index: Optional[torch.Tensor] = None  # prefill: (N,) padded row of each real query
    max_query: int = 1

    @property
    def is_decode(self) -> bool:
        return self.query_index is None


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor     # (T,) long: where each new token's K/V is written
    block_size: int
    groups: list[GroupMetadata]


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
            scale: float) -> torch.Tensor:
    return F.scaled_dot_product_attention(
        q, keys, values, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != keys.shape[1]
    )


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor, block_size: int) -> torch.Tensor:
    """(B, W) block tables -> (B, kv_heads, W * block_size, head_dim) keys or values."""
    b, w = block_ids.shape
    _, hkv, d = cache.shape
    rows = cache.view(-1, block_size * hkv * d).index_select(0, block_ids.flatten())
    return rows.view(b, w * block_size, hkv, d).transpose(1, 2)


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor,
    meta: AttentionMetadata, scale: float,
) -> torch.Tensor:
    """q (T, H, D), k/v (T, Hkv, D) for the new tokens -> attention output (T, H*D)."""
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    T, H, D = q.shape
    outs = []
    for g in meta.groups:
        keys = gather_blocks(k_cache, g.block_ids, meta.block_size)   # (B, Hkv, L, D)
        values = gather_blocks(v_cache, g.block_ids, meta.block_size)
        qg = q[g.token_start:g.token_start + g.num_tokens]
        b = g.block_ids.shape[0]
        if g.is_decode:
            # the G query heads sharing a KV head act as G queries of that head
            hkv = keys.shape[1]
            o = _attend(qg.view(b, hkv, H // hkv, D), keys, values, g.mask, scale)
            outs.append(o.reshape(b, H * D))
        else:
            qp = qg.index_select(0, g.query_index).view(b, g.max_query, H, D).transpose(1, 2)
            o = _attend(qp, keys, values, g.mask, scale)           # (B, H, Qmax, D)
            o = o.transpose(1, 2).reshape(b * g.max_query, H * D)
            outs.append(o.index_select(0, g.output_index))
    return outs[0] if len(outs) == 1 else torch.cat(outs, 0)
