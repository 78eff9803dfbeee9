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
