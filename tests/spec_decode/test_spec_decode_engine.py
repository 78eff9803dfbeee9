"""Speculative decoding in the engine core with a fake runner (no torch): n-gram proposals,
scheduling k + 1 tokens, greedy verification, KV rollback, stop checks, adaptivity."""
from __future__ import annotations

import pytest

from llmserve.engine.kv.kv_cache_manager import KVCacheManager
from llmserve.engine.request import Request, RequestStatus
from llmserve.sampling_params import SamplingParams
from llmserve.spec_decode.decoder import SpecDecodeConfig, SpecState, SpeculativeDecoder
from llmserve.spec_decode.proposers import NgramIndex, NgramProposer, PredictionState
from llmserve.spec_decode.suffix_proposer import SuffixProposer
from tests.engine.conftest import BLOCK, make_core

VOCAB = 16   # the fake runner emits 10 + sum % 6: short cycles, so n-grams repeat


def spec_core(k=4, max_batch=16, adaptive=True, method="ngram", **kw):
    core = make_core(**kw)
    core.runner.vocab = VOCAB
    cfg = SpecDecodeConfig(method=method, num_speculative_tokens=k, ngram_min=1, ngram_max=3,
                           max_batch=max_batch, adaptive=adaptive)
    proposer = NgramProposer(1, 3) if method == "ngram" else SuffixProposer(16, 0.1, 10_000)
    core.spec = SpeculativeDecoder(cfg, proposer)
    return core


def plain_core(**kw):
    core = make_core(**kw)
    core.runner.vocab = VOCAB
    return core


def req(rid, prompt, max_tokens=30, **params):
    params.setdefault("ignore_eos", True)
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0,
                                                     **params), max_model_len=4096)


PROMPTS = [[11, 12, 13, 11, 12, 13, 11, 12], [14, 15, 14, 15, 10], list(range(20, 37)),
           [12] * 9, [13, 11, 10, 13, 11, 10, 13]]


def run(core, requests, max_steps=2000):
    """Run to the end; returns {rid: (output tokens, finish reason)}; every step checks the
    KV ledger (make_core turns check_invariants on)."""
    for r in requests:
        core.add_request(r)
    out = {}
    for _ in range(max_steps):
        if not core.scheduler.requests:
            break
        for u in core.step():
            if u.delta.finish_reason:
                out[u.request.request_id] = (list(u.request.output_token_ids),
                                             u.delta.finish_reason)
        s = core.schedules[-1] if core.schedules else None
        if s is not None:
            assert s.num_batched_tokens <= core.scheduler.config.max_num_batched_tokens
    assert not core.scheduler.requests
    assert core.kv.num_used_blocks == 0
    return out


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_greedy_identical_with_speculation_mixed_batch(method):
    ref = run(plain_core(), [req(f"r{i}", p) for i, p in enumerate(PROMPTS)])
    core = spec_core(method=method)
    # r1 never proposes (its state pauses it for the whole run); in steps where the others
    # draft it verifies fillers only (uniform steps), which count as nobody's drafts
    reqs = [req(f"r{i}", p) for i, p in enumerate(PROMPTS)]
    reqs[1].spec_state = SpecState()
    reqs[1].spec_state.paused_until = 10**9
    got = run(core, reqs)
    assert got == ref
    stats = core.spec.stats
    assert stats.accepted_tokens > 20 and stats.proposed_tokens >= stats.accepted_tokens
    assert sum(stats.acceptance_lengths) == stats.num_verifications
    drafted = {s.request.request_id for sch in core.schedules for s in sch.scheduled
               if s.num_draft_tokens}
    assert {"r0", "r3"} <= drafted
    assert reqs[1].spec_state.ema == 1.0 and reqs[1].spec_state.backoff == 4   # never adapted
    # fewer steps than one token per step
    assert len(core.schedules) < len(run(plain_core(), [req("x", PROMPTS[0])])) + 60


def test_speculation_takes_fewer_steps():
    plain = plain_core()
    run(plain, [req("a", PROMPTS[3], max_tokens=60)])
    spec = spec_core()
    run(spec, [req("a", PROMPTS[3], max_tokens=60)])
    assert len(spec.schedules) < 0.6 * len(plain.schedules)


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_identical_through_preemption_and_budget_limits(method):
    reqs = lambda: [req(f"r{i}", p, max_tokens=40) for i, p in enumerate(PROMPTS)]  # noqa: E731
    ref = run(plain_core(num_blocks=64), reqs())
    core = spec_core(num_blocks=18, max_num_batched_tokens=9, method=method)
    got = run(core, reqs())
    assert core.scheduler.num_preemptions > 0
    assert got == ref
    assert core.spec.stats.accepted_tokens > 0


def test_stop_tokens_and_max_tokens_checked_on_accepted_tokens_in_order():
    ref = run(plain_core(), [req("a", PROMPTS[3], max_tokens=50, stop_token_ids=[14]),
                             req("b", PROMPTS[0], max_tokens=7)])
    core = spec_core()
    got = run(core, [req("a", PROMPTS[3], max_tokens=50, stop_token_ids=[14]),
                     req("b", PROMPTS[0], max_tokens=7)])
    assert got == ref
    assert got["a"][1] == "stop" and got["a"][0][-1] == 14
    assert len(got["b"][0]) == 7 and got["b"][1] == "length"


def test_min_tokens_with_speculation_matches():
    # the fake runner ignores min_tokens masks; the output processor still must not stop early
    ref = run(plain_core(), [req("a", PROMPTS[3], max_tokens=40, stop_token_ids=[14],
                                 min_tokens=12)])
    got = run(spec_core(), [req("a", PROMPTS[3], max_tokens=40, stop_token_ids=[14],
                                min_tokens=12)])
    assert got == ref


def test_no_speculation_above_max_batch():
    core = spec_core(max_batch=2)
    run(core, [req(f"r{i}", p, max_tokens=12) for i, p in enumerate(PROMPTS)])
    for sch in core.schedules:
        running = len(sch.scheduled)
        if running > 2:
            assert all(s.num_draft_tokens == 0 for s in sch.scheduled)


def test_low_acceptance_pauses_a_request():
    core = spec_core()
    r = req("a", PROMPTS[0], max_tokens=10)
    r.spec_state = SpecState()
    for step in (4, 5, 6):   # three drafts rejected outright
        core.spec._adapt(r.spec_state, 0.0, step=step)
    assert r.spec_state.paused_until > 6
    assert core.spec._num_drafts(r, r.spec_state, 7) == 0
    later = r.spec_state.paused_until
    assert 1 <= core.spec._num_drafts(r, r.spec_state, later) < 4


def test_suffix_requests_never_back_off():
    """Suffix drafts carry their own confidence: a request whose drafts were rejected
    drafts its full k again at the next step (a back-off slowed copying after new text),
    while its acceptance average still falls and is floored for the per-step plan."""
    core = spec_core(k=6, method="suffix")
    r = req("a", PROMPTS[0], max_tokens=40)
    r.spec_state = SpecState()
    for step in (4, 5, 6):
        core.spec._adapt(r.spec_state, 0.0, step=step)
    assert r.spec_state.paused_until == 0
    assert r.spec_state.ema == pytest.approx(0.3)   # floored: the plan still tries a draft
    assert core.spec._num_drafts(r, r.spec_state, 7) == 6
    # a client's prediction in the same engine still backs off (it has no confidence)
    p = req("p", PROMPTS[0], max_tokens=40)
    p.spec_state = core.spec.prediction_state("p", [5, 6, 7, 8])
    for step in (4, 5, 6):
        core.spec._adapt(p.spec_state, 0.0, step=step)
    assert p.spec_state.paused_until > 6
    assert core.spec._num_drafts(p, p.spec_state, 7) == 0


def test_kv_lookahead_is_not_cached_and_trim_rolls_back():
    kv = KVCacheManager(16, BLOCK, enable_prefix_caching=True, fingerprint="t")
    r = Request("a", list(range(20, 27)), SamplingParams(max_tokens=20), max_model_len=64)
    assert kv.allocate_slots(r, 7)
    r.num_computed_tokens = 6           # the last prompt token computes next, as a decode
    r.append_token(5)                   # 8 tokens: two full blocks once computed
    r.num_computed_tokens = 7
    assert kv.allocate_slots(r, 1, num_lookahead_tokens=6)   # positions 7..13: 4 blocks
    assert len(kv.blocks_of("a")) == 4
    cached = [b for b in kv.pool.blocks if b.block_hash is not None]
    assert len(cached) == 2             # committed blocks only, never the draft ones
    assert kv.trim(r, 9) == 1           # one accepted draft: 9 tokens need 3 blocks
    assert len(kv.blocks_of("a")) == 3
    kv.check_invariants()
    kv.free(r)
    kv.check_invariants()
    assert kv.num_used_blocks == 0


def test_ngram_index_latest_longest_match():
    idx = NgramIndex(1, 3)
    toks = [1, 2, 3, 9, 1, 2, 4, 7, 2, 3, 1, 2]
    idx.extend(toks)
    # suffix (3, 1, 2)? no earlier; (1, 2) latest earlier occurrence ends at 5 -> next is 4
    assert idx.match(toks) == 5
    toks += [3]
    idx.extend(toks)
    assert idx.match(toks) == 2        # the longest suffix (1, 2, 3) beats a later (2, 3)
    toks += [5]
    idx.extend(toks)
    assert idx.match(toks) is None     # 5 never occurred before
    p = NgramProposer(1, 3)
    r = Request("x", toks[:-1], SamplingParams(), max_model_len=64)
    r.spec_state = SpecState()
    assert p.propose([r], [3])[0].token_ids == [9, 1, 2]
    # the index grows with the sequence, never rebuilt
    assert r.spec_state.ngram_index.num_indexed == r.num_tokens - 1
    r.append_token(9)
    assert p.propose([r], [2])[0].token_ids == [1, 2]     # (3, 9) -> 1, 2
    assert r.spec_state.ngram_index.num_indexed == r.num_tokens - 1


def test_prediction_proposals_first():
    p = NgramProposer(1, 3, use_history=False)
    r = Request("x", [5, 6, 7], SamplingParams(), max_model_len=64)
    r.spec_state = SpecState(PredictionState([40, 41, 42, 43, 44], 1, 3))
    first = p.propose([r], [3])[0]
    assert first.token_ids == [40, 41, 42] and first.from_prediction
    r.append_token(40)
    r.append_token(41)
    assert p.propose([r], [2])[0].token_ids == [42, 43]
    assert r.status is RequestStatus.WAITING
