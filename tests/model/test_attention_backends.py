"""Every attention backend against the reference (gather + SDPA): same logits, same tokens.

Mixed batches of long and short contexts, GQA and MQA, chunked prefill (a small token
budget splits long prompts), fp32. The paged backend's in-place decode formulation (used
inside the compiled step) is also checked directly, eagerly and compiled.
"""
from __future__ import annotations

import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.model.attention.backend import make_backend
from llmserve.model.attention.paged import paged_decode_inplace, paged_verify_inplace
from llmserve.model.attention.reference import decode_group_attention
from llmserve.model.executor.capture import LogitsCapture
from tests.model.tiny_checkpoints import make_tiny_checkpoint

# long and short contexts in one batch; 90 tokens cross several 16-token blocks
PROMPTS = [list(range(100, 190)), [5, 17, 300], list(range(400, 437)), [11, 12, 13, 14, 15]]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module", params=[(4, 2), (4, 1), (4, 4)], ids=["gqa", "mqa", "mha"])
def tiny_path(request, tmp_path_factory):
    heads, kv_heads = request.param
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp(f"attn{kv_heads}")), arch="llama",
                                num_heads=heads, num_kv_heads=kv_heads, seed=11)


def _run(path: str, backend: str, **kw):
    llm = LLM(path, dtype="float32", num_kv_blocks=128, attention_backend=backend,
              check_invariants=True, **kw)
    runner = llm.engine.runner
    runner.capture = LogitsCapture.SAMPLED
    steps = []
    inner = runner.execute
    runner.execute = lambda step: steps.append(inner(step)) or steps[-1]
    outs = llm.generate(PROMPTS, GREEDY)
    logits = {}
    for out in steps:
        for j, rid in enumerate(out.request_ids):
            logits.setdefault(rid, []).append(out.logits[j])
    return [o.outputs[0].token_ids for o in outs], {k: torch.stack(v) for k, v in logits.items()}


@pytest.mark.parametrize("budget", [2048, 24], ids=["whole-prompts", "chunked-prefill"])
def test_paged_backend_matches_reference(tiny_path, budget):
    kw = dict(max_num_batched_tokens=budget)
    ref_tokens, ref_logits = _run(tiny_path, "reference", **kw)
    tokens, logits = _run(tiny_path, "paged", **kw)
    assert tokens == ref_tokens
    assert ref_logits.keys() == logits.keys()
    for rid in ref_logits:
        torch.testing.assert_close(logits[rid], ref_logits[rid], atol=2e-4, rtol=1e-4)


def test_reference_backend_compiled_decode_traces_and_gives_the_eager_tokens(tmp_path):
    """The reference backend's compiled decode step attends through the CPU op (each row's
    key width is read from its mask, which a trace cannot branch on): the trace must not
    fail (a failed one falls back to eager steps, logged only), and the tokens and logits
    equal the eager run's."""
    path = make_tiny_checkpoint(str(tmp_path / "m"), arch="llama", num_heads=4, num_kv_heads=2,
                                seed=11)
    got = {}
    for eager in (True, False):
        llm = LLM(path, dtype="float32", num_kv_blocks=128, attention_backend="reference",
                  enforce_eager=eager, max_num_seqs=8)
        runner = llm.engine.runner
        runner.capture = LogitsCapture.SAMPLED
        steps = []
        inner = runner.execute
        runner.execute = lambda step, inner=inner, steps=steps: steps.append(inner(step)) or steps[-1]
        outs = llm.generate(PROMPTS, GREEDY)
        if not eager:
            assert runner.compiled is not None and not runner.compiled.failed
        got[eager] = ([o.outputs[0].token_ids for o in outs],
                      torch.cat([s.logits for s in steps if s.logits is not None]))
    assert got[False][0] == got[True][0]
    assert torch.equal(got[False][1], got[True][1])


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 1), (4, 4)])
def test_inplace_decode_equals_gather_sdpa(heads, kv_heads):
    torch.manual_seed(0)
    bs, d = 16, 64
    k_cache = torch.randn(20 * bs, kv_heads, d)
    v_cache = torch.randn(20 * bs, kv_heads, d)
    tables = torch.tensor([[1, 5, 7], [2, 3, 19], [4, 0, 0]])   # past ctx: padding
    ctx = torch.tensor([40, 33, 5])
    q = torch.randn(3, heads, d)
    backend = make_backend("paged", heads, kv_heads, d, bs)
    meta = backend.decode_metadata(torch.zeros(3, dtype=torch.long), tables, ctx)
    ref = decode_group_attention(q, k_cache, v_cache, tables, meta.decode_valid, bs, 0.125)
    got = paged_decode_inplace(q, k_cache, v_cache, meta.decode_slots, meta.decode_valid, 0.125)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    compiled = torch.compile(paged_decode_inplace, dynamic=True)
    torch.testing.assert_close(compiled(q, k_cache, v_cache, meta.decode_slots, meta.decode_valid,
                                        0.125), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window,softcap", [(None, None), (6, None), (None, 20.0)])
def test_inplace_verify_rows_equal_one_decode_per_row(window, softcap):
    """Q rows per sequence, each masked to the keys at or before its position (and inside
    a sliding window): every row equals a decode whose context ends at that row."""
    torch.manual_seed(1)
    bs, d, heads, kv_heads, q_rows = 16, 32, 4, 2, 3
    k_cache = torch.randn(20 * bs, kv_heads, d)
    v_cache = torch.randn(20 * bs, kv_heads, d)
    tables = torch.tensor([[1, 5, 7], [2, 3, 19]])
    positions = torch.tensor([[30, 31, 32], [12, 13, 13]])   # second: one padded row
    q = torch.randn(2 * q_rows, heads, d)
    backend = make_backend("paged", heads, kv_heads, d, bs)
    meta = backend.verify_metadata(torch.zeros(2 * q_rows, dtype=torch.long), tables, positions)
    got = paged_verify_inplace(q, k_cache, v_cache, meta.decode_slots,
                               meta.decode_valid_for(window), 0.125, softcap)
    for b in range(2):
        for j in range(q_rows):
            ctx = positions[b, j:j + 1] + 1
            one = backend.decode_metadata(torch.zeros(1, dtype=torch.long), tables[b:b + 1], ctx)
            ref = paged_decode_inplace(q[b * q_rows + j:b * q_rows + j + 1], k_cache, v_cache,
                                       one.decode_slots, one.decode_valid_for(window), 0.125,
                                       softcap)
            torch.testing.assert_close(got[b * q_rows + j:b * q_rows + j + 1], ref,
                                       atol=1e-5, rtol=1e-5)


def test_unknown_backend_is_a_clear_error(tiny_path):
    with pytest.raises(ValueError, match="attention_backend"):
        LLM(tiny_path, attention_backend="flash")


def test_verify_step_rows_are_bit_identical_to_decodes_with_the_native_kernel():
    """A verify step through the backend (bf16, the native kernel): each draft row's output
    equals, bit for bit, the plain decode at its position, so speculation changes no
    greedy token (issue 34). Before, verify rows took their own reduction."""
    from llmserve.model.attention.native_decode import native_decode_available

    if not native_decode_available():
        pytest.skip("the native decode kernel is not loaded on this machine")
    torch.manual_seed(2)
    bs, d, heads, kv_heads, q_rows = 16, 64, 9, 3, 4
    k_cache = torch.randn(24 * bs, kv_heads, d).bfloat16()
    v_cache = torch.randn(24 * bs, kv_heads, d).bfloat16()
    tables = torch.tensor([[1, 5, 7, 9, 11], [2, 3, 19, 0, 0]])
    positions = torch.tensor([[70, 71, 72, 73], [29, 30, 31, 32]])
    q = torch.randn(2 * q_rows, heads, d).bfloat16()
    backend = make_backend("paged", heads, kv_heads, d, bs, torch.bfloat16)
    assert backend.native_decode
    new_kv = torch.zeros(0, kv_heads, d).bfloat16()
    slots = torch.zeros(0, dtype=torch.long)
    # as in the compiled verify step: metadata and attention inside one graph
    def verify(q, k_cache, v_cache, tables, positions):
        meta = backend.verify_metadata(slots, tables, positions)
        return backend.forward(q, new_kv, new_kv, k_cache, v_cache, meta, 0.125)

    got = torch.compile(verify, fullgraph=True)(q, k_cache, v_cache, tables, positions)
    for b in range(2):
        for j in range(q_rows):
            one = backend.decode_metadata(slots, tables[b:b + 1], positions[b, j:j + 1] + 1)
            row = b * q_rows + j
            ref = backend.forward(q[row:row + 1], new_kv, new_kv, k_cache, v_cache, one, 0.125)
            assert torch.equal(got[row:row + 1], ref), (b, j)
