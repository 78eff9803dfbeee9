"""The paged backend: decodes read the paged KV cache in place.

All decode rows of a step form one batch over the widest block table among them. Where the
CPU tier's native kernel is loaded (bf16 query and cache), decodes use it, compiled or eager
(:mod:`~llmserve.model.attention.native_decode`): it reads each K and V row where it lives
through the slot table. A compiled verify step (``Q`` rows per sequence: a decode with its
drafts) runs each of its rows as the decode at that position (the same sums as a plain
decode, so speculation does not change a greedy token), and prefill chunks run one
decode-like row per query against its own causal keys (:func:`_native_prefill_rows`),
faster than SDPA with a mask on these shapes (docs/BENCHMARKS.md).

An 8-bit KV cache (int8, fp8 e4m3) takes a native kernel too on every tier with a library
(it reads each row's codes and scale in place). Without a native kernel (the none tier)
eager decode rows gather their blocks and call SDPA (:func:`torch_decode_attention`), and
prefill rows attend the same way, each as the decode at its position
(:func:`~llmserve.model.attention.reference.prompt_rows_as_decodes`). On the none tier compiled
decodes call the same op, so a row attends alike in both; elsewhere without the kernel
(other devices, a head size not of 16k) compiled decode and verify steps write the
attention as
reductions inductor turns into loops over the cache (:func:`paged_decode_inplace`,
:func:`paged_verify_inplace`), faster but summed in inductor's order::

    s[b, q, l, h, g] = sum_d q[b, q, h, g, d] * K[slot[b, l], h, d]  (l <= pos[b, q], else -inf)
    o[b, q, h, g, d] = sum_l softmax_l(s)[b, q, l, h, g] * V[slot[b, l], h, d]
"""
from __future__ import annotations

from typing import Optional

import torch

from llmserve.model.attention.backend import AttentionMetadata, GroupMetadata, StepBatch, write_kv
from llmserve.model.attention.native_decode import (
    kv_store_native,
    native_decode_kernel,
    native_decode_serves,
    native_kv_store_available,
    paged_decode_native,
)
from llmserve.model.attention.reference import (
    ReferenceBackend,
    decode_group_attention,
    prompt_rows_as_decodes,
    torch_decode_attention,
)
from llmserve.model.native.ops import tier_ops
from llmserve.model.quant.kv import load_kv


def paged_decode_inplace(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         slots: torch.Tensor, valid: torch.Tensor, scale: float,
                         softcap: Optional[float] = None) -> torch.Tensor:
    """``q (B, H, D)`` against each sequence's cached rows ``slots (B, L)`` -> ``(B, H * D)``.

    ``valid (B, L)`` masks keys (past the context, or outside a sliding window); ``softcap``
    caps the scaled scores at ``softcap * tanh(s / softcap)`` before the mask."""
    b, h, d = q.shape
    hkv = k_cache.shape[1]
    g = h // hkv
    length = slots.shape[1]
    qf = q.view(b, 1, hkv, g, d).float()
    keys = load_kv(k_cache[slots], torch.float32).unsqueeze(3)  # (B, L, Hkv, 1, D), fused load
    scores = (qf * keys).sum(-1) * scale                        # (B, L, Hkv, G)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~valid.view(b, length, 1, 1), float("-inf"))
    probs = torch.softmax(scores, dim=1)
    values = load_kv(v_cache[slots], torch.float32).unsqueeze(3)  # (B, L, Hkv, 1, D)
    out = (probs.unsqueeze(-1) * values).sum(1)                 # (B, Hkv, G, D)
    return out.reshape(b, h * d).to(q.dtype)


def paged_verify_inplace(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         slots: torch.Tensor, valid: torch.Tensor, scale: float,
                         softcap: Optional[float] = None) -> torch.Tensor:
    """``paged_decode_inplace`` for ``Q`` query rows per sequence: ``q (B * Q, H, D)``,
    ``valid (B, Q, L)`` -> ``(B * Q, H * D)``."""
    b, nq, length = valid.shape
    h, d = q.shape[1], q.shape[2]
    hkv = k_cache.shape[1]
    g = h // hkv
    qf = q.view(b, nq, 1, hkv, g, d).float()
    keys = load_kv(k_cache[slots], torch.float32).view(b, 1, length, hkv, 1, d)
    scores = (qf * keys).sum(-1) * scale                        # (B, Q, L, Hkv, G)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~valid.view(b, nq, length, 1, 1), float("-inf"))
    probs = torch.softmax(scores, dim=2)
    values = load_kv(v_cache[slots], torch.float32).view(b, 1, length, hkv, 1, d)
    out = (probs.unsqueeze(-1) * values).sum(2)                 # (B, Q, Hkv, G, D)
    return out.reshape(b * nq, h * d).to(q.dtype)


#: Largest (query rows x keys) table a prefill group builds for the native kernel (9 bytes
#: an entry); beyond it the group takes the reference path.
NATIVE_PREFILL_MAX_ENTRIES = 1 << 22


def _native_prefill_rows(g: GroupMetadata, block_size: int,
                         window: Optional[int]) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """``(slots, valid)`` of each real query row of a prefill group, ``(N, W * block_size)``:
    its sequence's cache rows and the keys at or before its position (inside ``window``).
    Built once per step and window; None for decode groups and oversized tables."""
    if g.is_decode or g.num_tokens * g.mask.shape[-1] > NATIVE_PREFILL_MAX_ENTRIES:
        return None

    def build() -> tuple[torch.Tensor, torch.Tensor]:
        b, w = g.block_ids.shape
        offsets = torch.arange(block_size, device=g.block_ids.device)
        slots = (g.block_ids.unsqueeze(-1) * block_size + offsets).view(b, w * block_size)
        valid = g.mask_for(window).reshape(b * g.max_query, -1).index_select(0, g.output_index)
        return (slots.index_select(0, torch.div(g.output_index, g.max_query,
                                                rounding_mode="floor")), valid)
    return g.cached(("native", window), build)


class PagedBackend(ReferenceBackend):
    """In-place paged decodes (native kernel or compiled reductions); prefill chunks by the
    native kernel (one causal row each) where it is loaded, else grouped gather + SDPA."""

    name = "paged"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                 dtype: torch.dtype = torch.float32, kv_dtype: torch.dtype = torch.float32,
                 device: Optional[torch.device] = None) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, block_size)
        # decided here, once, never inside a traced step (the first check builds and tests
        # the kernel): it serves CPU queries over a cache of their dtype (bf16, and float32
        # where the avx2 library is loaded: its own tier, or beside the AVX-512 one) or
        # over an 8-bit cache (int8, fp8: on every tier with a library), head sizes of 16k
        self.native_decode = ((device is None or device.type == "cpu")
                              and head_dim % 16 == 0 and native_decode_serves(dtype, kv_dtype))
        kernel = native_decode_kernel(dtype, kv_dtype) if self.native_decode else None
        #: the native operator decodes and prompt rows call, for the kernel plan
        self.decode_kernel = f"{kernel[1]} ({kernel[0]})" if kernel else None
        # eager steps write their K/V rows by native row copies (compiled steps keep the
        # copy inductor fuses with the rotary embedding): the same bytes
        self.native_store = (self.native_decode and kv_dtype == torch.bfloat16
                             and native_kv_store_available())
        # without the kernel, compiled decodes attend by inductor's loops where the tier has
        # a library (pairs no kernel takes: a float32 model over a bf16 or fp16 cache, head
        # sizes not of 16k; faster than the eager op, but a decode may then differ from the
        # same row in a mixed eager step) and on other devices, and by the eager gather +
        # SDPA op on the none tier, whose point is the exact fallback (a CPU-only op)
        self.inductor_decode = not self.native_decode and (
            tier_ops() is not None or (device is not None and device.type != "cpu"))

    def build_metadata(self, batch: StepBatch) -> AttentionMetadata:
        nd = batch.num_decodes
        bt, ctx = batch.block_tables, batch.context_lens
        if nd == len(batch.query_lens):
            w = max(batch.table_widths)
            return self.decode_metadata(batch.slot_mapping, bt[:, :w], ctx)
        meta = super().build_metadata(StepBatch(
            slot_mapping=batch.slot_mapping, block_tables=bt[nd:], context_lens=ctx[nd:],
            num_decodes=0, query_lens=batch.query_lens[nd:],
            context_lens_host=batch.context_lens_host[nd:],
            table_widths=batch.table_widths[nd:]))
        for g in meta.groups:
            g.token_start += nd
        if nd:
            w = max(batch.table_widths[:nd])
            dec = self.decode_metadata(batch.slot_mapping, bt[:nd, :w], ctx[:nd])
            meta.num_decodes = nd
            meta.decode_block_tables = dec.decode_block_tables
            meta.decode_valid = dec.decode_valid
            meta.decode_slots = dec.decode_slots
            meta.decode_context_lens = dec.decode_context_lens
        return meta

    def group_outputs(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      meta: AttentionMetadata, scale: float, groups: list[GroupMetadata],
                      window: Optional[int] = None,
                      softcap: Optional[float] = None) -> list[torch.Tensor]:
        """Prefill groups through the native kernel where it serves them (each query row
        is a decode against its own causal keys), the rest through the reference; on the
        none tier each row as its decode by the eager op (:func:`prompt_rows_as_decodes`)."""
        if not self.native_decode:
            if self.inductor_decode:
                return super().group_outputs(q, k_cache, v_cache, meta, scale, groups,
                                             window, softcap)
            return [prompt_rows_as_decodes(q[g.token_start:g.token_start + g.num_tokens],
                                           k_cache, v_cache, g, meta.block_size, scale,
                                           window, softcap)
                    for g in groups]
        outs = []
        for g in groups:
            rows = _native_prefill_rows(g, meta.block_size, window)
            if rows is None:
                outs.extend(super().group_outputs(q, k_cache, v_cache, meta, scale, [g],
                                                  window, softcap))
                continue
            qg = q[g.token_start:g.token_start + g.num_tokens]
            outs.append(paged_decode_native(qg, k_cache, v_cache, rows[0], rows[1], scale,
                                            softcap))
        return outs

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float, window: Optional[int] = None,
                softcap: Optional[float] = None) -> torch.Tensor:
        if self.native_store and not torch.compiler.is_compiling():
            kv_store_native(k_cache, meta.slot_mapping, k)
            kv_store_native(v_cache, meta.slot_mapping, v)
        else:
            write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        outs = []
        nd = meta.num_decodes
        if nd:
            qd = q[:nd]
            valid = meta.decode_valid_for(window)
            if meta.decode_positions is not None:   # compiled verify step
                b, nq, length = valid.shape
                if self.native_decode:
                    # each query row as the decode at its position: the kernel (and the
                    # order of its sums) of a plain decode, so verifying a draft gives the
                    # logits decoding it would
                    outs.append(paged_decode_native(
                        qd, k_cache, v_cache, meta.decode_slots.repeat_interleave(nq, dim=0),
                        valid.reshape(b * nq, length), scale, softcap))
                elif not self.inductor_decode:
                    # the none tier: each row through the op its plain decode calls
                    outs.append(torch_decode_attention(
                        qd, k_cache, v_cache,
                        meta.decode_block_tables.repeat_interleave(nq, dim=0),
                        valid.reshape(b * nq, length), meta.block_size, scale, softcap or 0.0))
                else:
                    outs.append(paged_verify_inplace(qd, k_cache, v_cache, meta.decode_slots,
                                                     valid, scale, softcap))
            elif self.native_decode:
                outs.append(paged_decode_native(qd, k_cache, v_cache, meta.decode_slots,
                                                valid, scale, softcap))
            elif self.inductor_decode and torch.compiler.is_compiling():
                outs.append(paged_decode_inplace(qd, k_cache, v_cache, meta.decode_slots,
                                                 valid, scale, softcap))
            elif torch.compiler.is_compiling():   # the none tier: the eager steps' sums
                outs.append(torch_decode_attention(qd, k_cache, v_cache,
                                                   meta.decode_block_tables, valid,
                                                   meta.block_size, scale, softcap or 0.0))
            else:   # eager: the gather + SDPA itself (the op wraps it for traces, on CPU)
                outs.append(decode_group_attention(qd, k_cache, v_cache,
                                                   meta.decode_block_tables, valid,
                                                   meta.block_size, scale, softcap))
        if meta.groups:
            outs.extend(self.group_outputs(q, k_cache, v_cache, meta, scale, meta.groups,
                                           window, softcap))
        return outs[0] if len(outs) == 1 else torch.cat(outs, 0)
