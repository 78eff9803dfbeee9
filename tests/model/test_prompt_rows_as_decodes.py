"""The none tier's prompt rows (``prompt_rows_as_decodes``): each row of a prefill chunk,
bit for bit, the decode at its position (``decode_group_attention`` over the same cache), so
chunking changes no sum on the tier without a native library. Head groups of 7 over 1 (the
case grouped SDPA summed otherwise), 4 over 2 and 9 over 3; a sliding window; soft-capped
scores (contiguous copies, in blocks); bf16 and int8 caches; two sequences in one group."""
from __future__ import annotations

import pytest
import torch

from llmserve.model.attention import reference
from llmserve.model.attention.backend import StepBatch
from llmserve.model.attention.reference import (
    ReferenceBackend,
    decode_group_attention,
    prompt_rows_as_decodes,
)
from llmserve.model.quant.kv import quantize_kv

BS, D = 16, 64


def _step(ctx: list[int], new: list[int], tables: torch.Tensor) -> StepBatch:
    slots = torch.cat([tables[i, (c - n + torch.arange(n)) // BS] * BS + (c - n + torch.arange(n)) % BS
                       for i, (c, n) in enumerate(zip(ctx, new))])
    return StepBatch(slot_mapping=slots, block_tables=tables, context_lens=torch.tensor(ctx),
                     num_decodes=0, query_lens=new, context_lens_host=ctx,
                     table_widths=[-(-c // BS) for c in ctx])


@pytest.mark.parametrize("heads,kv_heads", [(7, 1), (4, 2), (9, 3), (8, 4)])
@pytest.mark.parametrize("window,softcap", [(None, None), (24, None), (None, 30.0)])
@pytest.mark.parametrize("kv", [torch.bfloat16, torch.int8])
def test_each_prompt_row_attends_as_its_decode(heads, kv_heads, window, softcap, kv,
                                                monkeypatch):
    monkeypatch.setattr(reference, "SOFTCAP_BLOCK_BYTES", 3 * 4 * 16 * 64 * 2)  # blocks of rows
    gen = torch.Generator().manual_seed(heads + 10 * kv_heads)
    k = torch.randn(12 * BS, kv_heads, D, generator=gen)
    v = torch.randn(12 * BS, kv_heads, D, generator=gen)
    kc, vc = (quantize_kv(k, kv), quantize_kv(v, kv)) if kv == torch.int8 else (k.to(kv), v.to(kv))
    tables = torch.tensor([[3, 5, 7, 9, 0], [1, 2, 4, 6, 8]])
    ctx, new = [50, 62], [30, 26]                # both chunks past their first blocks
    meta = ReferenceBackend(heads, kv_heads, D, BS).build_metadata(_step(ctx, new, tables))
    assert len(meta.groups) == 1 and not meta.groups[0].is_decode
    q = torch.randn(sum(new), heads, D, generator=gen).bfloat16()
    got = prompt_rows_as_decodes(q, kc, vc, meta.groups[0], BS, D ** -0.5, window, softcap)
    assert got.shape == (sum(new), heads * D)
    row = 0
    for s, (c, n) in enumerate(zip(ctx, new)):
        for pos in range(c - n, c):
            keys = torch.arange(5 * BS)
            valid = keys <= pos
            if window is not None:
                valid &= keys > pos - window
            alone = decode_group_attention(q[row:row + 1], kc, vc, tables[s:s + 1],
                                           valid.view(1, -1), BS, D ** -0.5, softcap)
            assert torch.equal(got[row:row + 1], alone), (s, pos)
            row += 1


def test_key_width_follows_the_row_alone():
    assert [reference.key_width(w) for w in (1, 4, 7, 8, 9, 10, 15, 16, 17, 33, 65)] == \
        [8, 8, 8, 8, 10, 10, 16, 16, 20, 40, 80]
    for w in range(1, 300):
        kw = reference.key_width(w)
        assert w <= kw <= max(8, w + w // 4) and reference.key_width(kw) == kw


def test_a_decode_row_attends_over_its_own_key_width_whatever_its_batch():
    """Five decode rows of 16 heads over 2 of 128 (230-352 keys) in one step, their tables
    as wide as the widest row: each row, bit for bit, the row decoded alone over its own
    table. Padded to the widest table instead (``LLMSERVE_FAST_ROUNDING=1``), the first row
    came out otherwise with torch 2.13 on an AVX-512 EPYC (SDPA sums a row by its padded key
    count)."""
    hkv, g, d = 2, 8, 128
    cases = [(10, 1, 230), (25, 1, 275), (26, 6, 278), (29, 6, 287), (0, 1, 352)]
    width = 22                                       # (seed, key scale, keys) per row
    kc = torch.zeros(len(cases) * width * BS, hkv, d, dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    qs = []
    for r, (seed, key_scale, _) in enumerate(cases):
        gen = torch.Generator().manual_seed(seed)
        qs.append(torch.randn(hkv * g, d, generator=gen).bfloat16())
        rows = slice(r * width * BS, (r + 1) * width * BS)
        kc[rows] = (key_scale * torch.randn(hkv, width * BS, d, generator=gen)).bfloat16() \
            .transpose(0, 1)
        vc[rows] = torch.randn(hkv, width * BS, d, generator=gen).bfloat16().transpose(0, 1)
    q = torch.stack(qs)
    tables = torch.arange(len(cases) * width).view(len(cases), width)
    ctx = [n for _, _, n in cases]
    valid = torch.arange(width * BS).view(1, -1) < torch.tensor(ctx).view(-1, 1)
    got = decode_group_attention(q, kc, vc, tables, valid, BS, d ** -0.5)
    assert got.shape == (len(cases), hkv * g * d)
    for i, c in enumerate(ctx):
        own = -(-c // BS)
        alone = decode_group_attention(q[i:i + 1], kc, vc, tables[i:i + 1, :own],
                                       valid[i:i + 1, :own * BS], BS, d ** -0.5)
        assert torch.equal(got[i], alone[0]), i
