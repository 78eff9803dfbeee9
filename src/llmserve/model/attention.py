"""Paged attention in plain PyTorch: write new K/V through a slot mapping, gather each
sequence's keys through its block table, then one SDPA call per group.

The flat token batch of a step is laid out decodes first, then prefill chunks::

    tokens:  [d0 d1 ... d_{B-1} | p0 p0 p0 p0 | p1 p1 | ... ]
              one query each      chunk of seq 0, seq 1 ...

    decode group : q (Bd, H, 1, D) vs keys (Bd, Hkv, Ld, D), mask key < ctx_len
    prefill group: q padded to (Bp, H, Qmax, D) vs keys (Bp, Hkv, Lp, D),
                   mask key <= query position (causal over cached + new tokens)

All index tensors are built once per step (AttentionMetadata) and reused by every layer.
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
    """Index tensors of one attention group (decode or prefill)."""

    block_ids: torch.Tensor        # (B, W) long: each sequence's block table (padding -> block 0)
    mask: torch.Tensor             # (B, 1, Q, W * block_size) bool
    query_index: Optional[torch.Tensor] = None  # prefill: (B*Qmax,) flat-token index per padded query
    output_index: Optional[torch.Tensor] = None  # prefill: (Np,) padded row of each real query
    max_query: int = 1


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor     # (T,) long: where each new token's K/V is written
    block_size: int
    num_decode: int
    decode: Optional[GroupMetadata]
    prefill: Optional[GroupMetadata]


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
    nd = meta.num_decode
    if meta.decode is not None:
        g = meta.decode
        keys = gather_blocks(k_cache, g.block_ids, meta.block_size)   # (Bd, Hkv, L, D)
        values = gather_blocks(v_cache, g.block_ids, meta.block_size)
        # the G query heads sharing a KV head act as G queries of that head: no GQA expansion
        hkv = keys.shape[1]
        qd = q[:nd].view(nd, hkv, H // hkv, D)              # (Bd, Hkv, G, D)
        outs.append(_attend(qd, keys, values, g.mask, scale).reshape(nd, H * D))
    if meta.prefill is not None:
        g = meta.prefill
        bp = g.block_ids.shape[0]
        qp = q[nd:].index_select(0, g.query_index).view(bp, g.max_query, H, D).transpose(1, 2)
        keys = gather_blocks(k_cache, g.block_ids, meta.block_size)
        values = gather_blocks(v_cache, g.block_ids, meta.block_size)
        o = _attend(qp, keys, values, g.mask, scale)      # (Bp, H, Qmax, D)
        o = o.transpose(1, 2).reshape(bp * g.max_query, H * D)
        outs.append(o.index_select(0, g.output_index))
    return outs[0] if len(outs) == 1 else torch.cat(outs, 0)
