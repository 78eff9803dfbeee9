"""Sliding windows and score soft-capping in every attention path, against a brute-force
reference: the eager gather + SDPA decode, the in-place paged decode, prefill groups; and the
compiled decode step of a whole Gemma 2 model (window + caps: the in-place decode compiled)
against the same model run eagerly."""
from __future__ import annotations

import math

import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.model.attention.backend import StepBatch, make_backend
from llmserve.model.attention.paged import paged_decode_inplace
from llmserve.model.attention.reference import decode_group_attention
from tests.model.family_parity import ATOL, RTOL, StepRecorder
from tests.model.tiny_checkpoints import make_tiny_checkpoint

BS, D = 16, 32


def brute_force(q, keys, values, qpos, scale, window, softcap):
    """One sequence: q (Q, H, D) at positions qpos; keys/values (L, Hkv, D) at 0..L-1."""
    h, hkv = q.shape[1], keys.shape[1]
    k = keys.repeat_interleave(h // hkv, 1)
    v = values.repeat_interleave(h // hkv, 1)
    s = torch.einsum("qhd,lhd->hql", q, k) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    kpos = torch.arange(keys.shape[0])
    ok = kpos[None, :] <= qpos[:, None]
    if window is not None:
        ok &= kpos[None, :] > qpos[:, None] - window
    s = s.masked_fill(~ok[None], -math.inf)
    return torch.einsum("hql,lhd->qhd", s.softmax(-1), v).reshape(q.shape[0], -1)


@pytest.mark.parametrize("window,softcap", [(None, None), (7, None), (None, 0.8), (20, 0.8)])
def test_decode_paths_honour_window_and_softcap(window, softcap):
    torch.manual_seed(0)
    heads, kv_heads = 6, 2
    k_cache = torch.randn(20 * BS, kv_heads, D)
    v_cache = torch.randn(20 * BS, kv_heads, D)
    tables = torch.tensor([[1, 5, 7], [2, 3, 19], [4, 0, 0]])
    ctx = torch.tensor([40, 33, 5])
    q = torch.randn(3, heads, D)
    backend = make_backend("paged", heads, kv_heads, D, BS)
    meta = backend.decode_metadata(torch.zeros(3, dtype=torch.long), tables, ctx)
    valid = meta.decode_valid_for(window)
    expect = []
    for b in range(3):
        rows = (tables[b].unsqueeze(-1) * BS + torch.arange(BS)).flatten()[:ctx[b]]
        expect.append(brute_force(q[b:b + 1], k_cache[rows], v_cache[rows],
                                  torch.tensor([ctx[b] - 1]), 0.2, window, softcap))
    expect = torch.cat(expect)
    gathered = decode_group_attention(q, k_cache, v_cache, tables, valid, BS, 0.2, softcap)
    torch.testing.assert_close(gathered, expect, atol=1e-5, rtol=1e-5)
    inplace = paged_decode_inplace(q, k_cache, v_cache, meta.decode_slots, valid, 0.2, softcap)
    torch.testing.assert_close(inplace, expect, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["reference", "paged"])
def test_prefill_chunks_honour_window_and_softcap(name):
    """Two sequences continue from cached tokens with chunks of 5 and 9 new tokens."""
    torch.manual_seed(1)
    heads, kv_heads, window, softcap = 4, 2, 10, 1.5
    k_cache = torch.randn(10 * BS, kv_heads, D)
    v_cache = torch.randn(10 * BS, kv_heads, D)
    tables = torch.tensor([[3, 4, 0], [6, 7, 8]])
    qlens, ctx = [5, 9], [21, 40]
    q = torch.randn(sum(qlens), heads, D)
    backend = make_backend(name, heads, kv_heads, D, BS)
    new_k = torch.randn(sum(qlens), kv_heads, D)
    new_v = torch.randn(sum(qlens), kv_heads, D)
    slots = []
    for b, (n, c) in enumerate(zip(qlens, ctx)):
        slots += [int(tables[b, p // BS]) * BS + p % BS for p in range(c - n, c)]
    batch = StepBatch(slot_mapping=torch.tensor(slots), block_tables=tables,
                      context_lens=torch.tensor(ctx), num_decodes=0, query_lens=qlens,
                      context_lens_host=ctx, table_widths=[2, 3])
    meta = backend.build_metadata(batch)
    got = backend.forward(q, new_k, new_v, k_cache, v_cache, meta, 0.25, window, softcap)
    expect, start = [], 0
    for b, (n, c) in enumerate(zip(qlens, ctx)):
        rows = (tables[b].unsqueeze(-1) * BS + torch.arange(BS)).flatten()[:c]
        expect.append(brute_force(q[start:start + n], k_cache[rows], v_cache[rows],
                                  torch.arange(c - n, c), 0.25, window, softcap))
        start += n
    torch.testing.assert_close(got, torch.cat(expect), atol=1e-5, rtol=1e-5)


def test_compiled_decode_step_with_window_and_softcap(tmp_path):
    path = make_tiny_checkpoint(str(tmp_path), arch="gemma2", num_heads=4, num_kv_heads=2,
                                seed=9, config_overrides={
                                    "sliding_window": 12, "attn_logit_softcapping": 0.5,
                                    "final_logit_softcapping": 3.0,
                                    "layer_types": ["sliding_attention", "full_attention"]})
    prompts = [list(range(100, 137)), [5, 17, 300]]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    results = []
    for eager in (True, False):
        llm = LLM(path, dtype="float32", num_kv_blocks=64, max_num_seqs=2,
                  enforce_eager=eager, check_invariants=True)
        assert (llm.engine.runner.compiled is None) == eager
        rec = StepRecorder(llm)
        outs = llm.generate(prompts, params)
        results.append([(o.outputs[0].token_ids, rec.sampled_logits(o.request_id))
                        for o in outs])
        if not eager:
            assert not llm.engine.runner.compiled.failed
    for (tok_e, log_e), (tok_c, log_c) in zip(*results):
        assert tok_c == tok_e
        torch.testing.assert_close(log_c, log_e, atol=ATOL, rtol=RTOL)
