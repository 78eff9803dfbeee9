"""The reference backend: gather each sequence's K/V blocks, then one SDPA call per group.

Decodes and prefill chunks are split into groups of similar block-table width (powers of
two; chunks also by length), so one long context does not pad every short one::

    decode group : q (Bd, Hkv, G, D) vs keys (Bd, Hkv, L, D), mask key < ctx_len
    prefill group: q padded to (Bp, H, Qmax, D) vs keys (Bp, Hkv, L, D),
                   mask key <= query position (causal over cached + new tokens)

It copies every sequence's whole context per layer; it is the yardstick the other backends
are tested against, and the fallback for any step.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from llmserve.model.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    GroupMetadata,
    StepBatch,
    capped_attention,
    gather_blocks,
    write_kv,
)
from llmserve.model.layers.cpu_kernels import cpu_op
from llmserve.model.platform import env_flag


def group_key(query_len: int, table_width: int) -> tuple[int, int]:
    """(0 for a decode or log2 of the chunk length, log2 of the block-table width)."""
    kind = 0 if query_len == 1 else max(1, (query_len - 1).bit_length())
    return kind, (max(1, table_width) - 1).bit_length()


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
           scale: float, softcap: Optional[float] = None) -> torch.Tensor:
    """SDPA over ``q (B, H, Q, D)`` and ``keys/values (B, Hkv, L, D)``; soft-capped scores
    take :func:`capped_attention` (SDPA cannot transform scores)."""
    if softcap is not None:
        return capped_attention(q, keys, values, mask, scale, softcap)
    return F.scaled_dot_product_attention(
        q, keys, values, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != keys.shape[1])


#: :func:`key_width` rounds a width up to a multiple of ``2 ** (bits - KEY_WIDTH_BITS)``
KEY_WIDTH_BITS = 3
#: the fewest blocks a row attends over: a prompt's first rows share one call
MIN_KEY_WIDTH = 8


def key_width(width: int) -> int:
    """The block-table width a row whose keys end in block ``width`` attends over: at least
    :data:`MIN_KEY_WIDTH`, else ``width`` rounded up to a multiple of ``2 ** (bits - 3)``
    (at most ~1/4 more blocks; the extra keys are masked).

    SDPA sums a row differently when its padded key count changes (16 query heads over 2 of
    128 moved by up to 0.008 between a row's own width and its step's widest), so a row's
    key count follows from the row alone, never from its batch."""
    if width <= MIN_KEY_WIDTH:
        return MIN_KEY_WIDTH
    step = 1 << (width.bit_length() - KEY_WIDTH_BITS)
    return -(-width // step) * step


def _key_widths(valid: torch.Tensor, block_size: int) -> list[int]:
    """:func:`key_width` of each row of a key mask ``valid (R, L)``: past its last valid key.
    Under ``LLMSERVE_FAST_ROUNDING=1``, and off the CPU (whose GPU kernels split their sums
    by the batch anyway; no host read a layer), every row takes the mask's whole width: one
    SDPA call, sums that follow the step's widest table."""
    if env_flag("LLMSERVE_FAST_ROUNDING") or valid.device.type != "cpu":
        return [-(-valid.shape[1] // block_size)] * valid.shape[0]
    last = valid.shape[1] - valid.flip(1).to(torch.int8).argmax(1)
    return [key_width(-(-int(n) // block_size)) for n in last.tolist()]


def _fit(t: torch.Tensor, width: int, fill: "int | bool") -> torch.Tensor:
    """``t``'s last dim cut or padded with ``fill`` to ``width``."""
    if t.shape[-1] == width:
        return t
    if t.shape[-1] > width:
        return t[..., :width].contiguous()
    return F.pad(t, (0, width - t.shape[-1]), value=fill)


def _attend_decode_rows(qg: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_ids: torch.Tensor, valid: torch.Tensor, block_size: int,
                        scale: float, softcap: Optional[float]) -> torch.Tensor:
    """One SDPA call: rows ``qg (R, H, D)`` over their gathered tables, padded alike."""
    r, h, d = qg.shape
    keys = gather_blocks(k_cache, block_ids, block_size, qg.dtype)      # (R, Hkv, L, D)
    values = gather_blocks(v_cache, block_ids, block_size, qg.dtype)
    hkv = keys.shape[1]
    return attend(qg.reshape(r, hkv, h // hkv, d), keys, values, valid.view(r, 1, 1, -1),
                  scale, softcap).reshape(r, h * d)


def decode_group_attention(qg: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_ids: torch.Tensor, valid: torch.Tensor, block_size: int,
                           scale: float, softcap: Optional[float] = None) -> torch.Tensor:
    """One query per sequence: the G query heads sharing a KV head act as G queries of it.
    Each row attends over :func:`key_width` of its own keys' blocks (rows of one width share
    an SDPA call), so its sums do not depend on the widest table in its step."""
    if torch.compiler.is_compiling():   # a traced step off the CPU (the CPU's calls the op)
        return _attend_decode_rows(qg, k_cache, v_cache, block_ids, valid, block_size, scale,
                                   softcap)
    widths = _key_widths(valid, block_size)

    def rows_of_width(ids: torch.Tensor, ok: torch.Tensor, q: torch.Tensor,
                      width: int) -> torch.Tensor:
        return _attend_decode_rows(q, k_cache, v_cache, _fit(ids, width, 0),
                                   _fit(ok, width * block_size, False), block_size, scale,
                                   softcap)

    if len(set(widths)) == 1:
        return rows_of_width(block_ids, valid, qg, widths[0])
    out = qg.new_empty(qg.shape[0], qg.shape[1] * qg.shape[2])
    for width in sorted(set(widths)):
        index = torch.tensor([i for i, w in enumerate(widths) if w == width],
                             device=qg.device)
        out[index] = rows_of_width(block_ids[index], valid[index], qg[index], width)
    return out


def _torch_decode_attention_fake(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                 block_tables: torch.Tensor, valid: torch.Tensor,
                                 block_size: int, scale: float, softcap: float) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


@cpu_op("torch_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor valid, int block_size, float scale, float softcap) -> Tensor",
        _torch_decode_attention_fake)
def torch_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, valid: torch.Tensor, block_size: int,
                           scale: float, softcap: float) -> torch.Tensor:
    """Decode rows without the native kernel (the none tier, a quantized KV cache, the
    reference backend on the CPU): the gathered blocks and SDPA of
    :func:`decode_group_attention`, behind one op, so a compiled decode step attends exactly
    as an eager mixed step does (inductor's own loops summed in another order, and a
    sequence's logits then depended on whether a prefill shared its step; each row's key
    width is read from its mask, which a trace cannot branch on). ``softcap`` 0 means none."""
    return decode_group_attention(q, k_cache, v_cache, block_tables, valid, block_size, scale,
                                  softcap or None)


#: Largest broadcast context a soft-capped prompt block copies (bytes of K, then of V):
#: ``capped_attention``'s matmuls sum a row of an expanded view otherwise than a row of its
#: own, so soft-capped rows take contiguous copies, a bounded block of rows at a time.
SOFTCAP_BLOCK_BYTES = 64 << 20


def prompt_rows_as_decodes(qg: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           g: GroupMetadata, block_size: int, scale: float,
                           window: Optional[int] = None,
                           softcap: Optional[float] = None) -> torch.Tensor:
    """A prefill group's rows ``qg (N, H, D)``, each attended as the decode at its position:
    :func:`decode_group_attention`'s SDPA (the G query heads of a KV head as its G queries,
    the keys up to the row's position valid), so a prompt row gets the sums its decode
    would, whatever the chunking (grouped SDPA over a chunk's own query count sums
    otherwise: a 7-over-1 head group chunked by 16 moved logits by ~0.016), each over the
    :func:`key_width` of its position, as its decode. A sequence's context is gathered once
    and broadcast to its rows (a view, not a copy; soft-capped rows take copies,
    :data:`SOFTCAP_BLOCK_BYTES` at a time); one SDPA call per run of its rows of one key
    width. A group of one-token chunks is a decode group already."""
    if g.is_decode:
        return decode_group_attention(qg, k_cache, v_cache, g.block_ids,
                                      g.mask_for(window).view(g.block_ids.shape[0], -1),
                                      block_size, scale, softcap)
    counts = g.cached("rows_per_sequence", lambda: torch.bincount(
        torch.div(g.output_index, g.max_query, rounding_mode="floor"),
        minlength=g.block_ids.shape[0]).tolist())
    mask = g.mask_for(window)                                # (B, 1, Qmax, L)
    h, d = qg.shape[1], qg.shape[2]
    outs, start = [], 0
    for b, n in enumerate(counts):
        widths = _key_widths(mask[b, 0, :n], block_size)
        ids = _fit(g.block_ids[b:b + 1], max(widths), 0)
        context = (gather_blocks(k_cache, ids, block_size, qg.dtype),
                   gather_blocks(v_cache, ids, block_size, qg.dtype))
        hkv = context[0].shape[1]
        run = 0
        while run < n:   # rows of one key width (positions rise: runs of rows)
            width = widths[run]
            end = run + 1
            while end < n and widths[end] == width:
                end += 1
            # the first keys of the gathered context: broadcast to the run's rows, the
            # strides of a context gathered at this width
            keys, values = (t[:, :, :width * block_size] for t in context)
            step = end - run if softcap is None else max(
                1, SOFTCAP_BLOCK_BYTES // (keys.numel() * keys.element_size()))
            for r in range(run, end, step):
                m = min(step, end - r)
                k, v = keys.expand(m, -1, -1, -1), values.expand(m, -1, -1, -1)
                if softcap is not None:
                    k, v = k.contiguous(), v.contiguous()
                o = attend(qg[start + r:start + r + m].view(m, hkv, h // hkv, d), k, v,
                           _fit(mask[b, 0, r:r + m], width * block_size, False)
                           .view(m, 1, 1, -1), scale, softcap)
                outs.append(o.reshape(m, h * d))
            run = end
        start += n
    return outs[0] if len(outs) == 1 else torch.cat(outs, 0)


class ReferenceBackend(AttentionBackend):
    """Gather + SDPA for every group; correct for any step, copies the context per layer."""

    name = "reference"

    def build_metadata(self, batch: StepBatch) -> AttentionMetadata:
        bs = self.block_size
        bt = batch.block_tables
        dev = bt.device
        keys = [group_key(q, w) for q, w in zip(batch.query_lens, batch.table_widths)]
        groups = []
        i = token = 0
        n = len(keys)
        while i < n:
            j = i + 1
            while j < n and keys[j] == keys[i]:
                j += 1
            w = max(batch.table_widths[i:j])
            qlens = batch.query_lens[i:j]
            n_tok = sum(qlens)
            ctx = batch.context_lens[i:j]
            key_pos = torch.arange(w * bs, device=dev)
            if keys[i][0] == 0:
                mask = (key_pos.unsqueeze(0) < ctx.unsqueeze(1)).view(j - i, 1, 1, -1)
                groups.append(GroupMetadata(token, n_tok, bt[i:j, :w], mask,
                                            query_pos=(ctx - 1).view(-1, 1, 1, 1),
                                            key_pos=key_pos))
            else:
                groups.append(self._prefill_group(bt[i:j, :w], qlens, ctx, token, n_tok, key_pos))
            token += n_tok
            i = j
        return AttentionMetadata(slot_mapping=batch.slot_mapping, block_size=bs, groups=groups)

    @staticmethod
    def _prefill_group(block_ids: torch.Tensor, qlens: list[int], ctx: torch.Tensor,
                       token_start: int, num_tokens: int, key_pos: torch.Tensor) -> GroupMetadata:
        dev = block_ids.device
        n = torch.tensor(qlens, device=dev)
        start = ctx - n
        qmax = max(qlens)
        qi = torch.arange(qmax, device=dev).unsqueeze(0)            # (1, Qmax)
        valid = qi < n.unsqueeze(1)                                 # (B, Qmax)
        offsets = torch.cumsum(n, 0) - n
        query_index = torch.where(valid, offsets.unsqueeze(1) + qi, 0).flatten()
        b = torch.arange(len(qlens), device=dev).unsqueeze(1)
        output_index = (b * qmax + qi)[valid]
        qpos = torch.where(valid, start.unsqueeze(1) + qi, 0)       # padded queries see key 0
        mask = (key_pos.view(1, 1, -1) <= qpos.unsqueeze(-1)).unsqueeze(1)
        return GroupMetadata(token_start, num_tokens, block_ids, mask, query_index=query_index,
                             output_index=output_index, max_query=qmax,
                             query_pos=qpos.view(len(qlens), 1, qmax, 1), key_pos=key_pos)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float, window: Optional[int] = None,
                softcap: Optional[float] = None) -> torch.Tensor:
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if not meta.groups:   # decode-only metadata (compiled step)
            if q.device.type == "cpu":   # behind the op: each row at its own key width
                return torch_decode_attention(q, k_cache, v_cache, meta.decode_block_tables,
                                              meta.decode_valid_for(window), meta.block_size,
                                              scale, softcap or 0.0)
            return decode_group_attention(q, k_cache, v_cache, meta.decode_block_tables,
                                          meta.decode_valid_for(window), meta.block_size, scale,
                                          softcap)
        outs = self.group_outputs(q, k_cache, v_cache, meta, scale, meta.groups, window, softcap)
        return outs[0] if len(outs) == 1 else torch.cat(outs, 0)

    def group_outputs(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      meta: AttentionMetadata, scale: float, groups: list[GroupMetadata],
                      window: Optional[int] = None,
                      softcap: Optional[float] = None) -> list[torch.Tensor]:
        """Attention output rows of each group, in order."""
        T, H, D = q.shape
        bs = meta.block_size
        outs = []
        for g in groups:
            qg = q[g.token_start:g.token_start + g.num_tokens]
            b = g.block_ids.shape[0]
            mask = g.mask_for(window)
            if g.is_decode:
                outs.append(decode_group_attention(qg, k_cache, v_cache, g.block_ids,
                                                   mask.view(b, -1), bs, scale, softcap))
                continue
            keys = gather_blocks(k_cache, g.block_ids, bs, q.dtype)
            values = gather_blocks(v_cache, g.block_ids, bs, q.dtype)
            qp = qg.index_select(0, g.query_index).view(b, g.max_query, H, D).transpose(1, 2)
            o = attend(qp, keys, values, mask, scale, softcap)       # (B, H, Qmax, D)
            o = o.transpose(1, 2).reshape(b * g.max_query, H * D)
            outs.append(o.index_select(0, g.output_index))
        return outs
