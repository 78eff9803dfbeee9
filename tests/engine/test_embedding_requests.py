"""Embedding requests in the engine core (fake runner, no torch): prefill-only requests
that share the token budget with generation, are never sampled or decoded, finish in
the step that computes their last prompt token with the runner's vector, and free their
KV blocks (the ledger is checked after every step)."""
from __future__ import annotations

import pytest

from llmserve.engine.request import Request
from llmserve.pooling_params import PoolingParams
from llmserve.protocol import FinishReason
from llmserve.sampling_params import SamplingParams
from tests.engine.conftest import make_core


def embed_req(rid, n_prompt, method="last", start_tok=20, salt=None):
    return Request(rid, list(range(start_tok, start_tok + n_prompt)), SamplingParams(max_tokens=1),
                   arrival_time=1000.0, cache_salt=salt, max_model_len=4096,
                   pooling=PoolingParams(method=method))


def gen_req(rid, n_prompt, max_tokens=6, start_tok=20):
    return Request(rid, list(range(start_tok, start_tok + n_prompt)),
                   SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0),
                   arrival_time=1000.0, max_model_len=4096)


def run(core, max_steps=1000):
    """Step until the engine is empty: {request id: final SequenceUpdate}, tokens seen."""
    final, tokens = {}, {}
    for _ in range(max_steps):
        if not core.scheduler.requests:
            return final, tokens
        for u in core.step():
            tokens.setdefault(u.request.request_id, []).extend(u.delta.token_ids)
            if u.delta.finish_reason is not None:
                final[u.request.request_id] = u
    raise AssertionError("did not finish")


def test_a_chunked_embedding_request_is_pooled_once_and_never_sampled():
    core = make_core(max_num_batched_tokens=64, max_prefill_tokens_per_step=8)
    core.add_request(embed_req("e", 20, method="mean"))
    final, tokens = run(core)
    upd = final["e"]
    assert upd.delta.finish_reason == FinishReason.STOP and upd.delta.token_ids == []
    assert tokens["e"] == []
    # three chunks of 8, 8, 4 prompt tokens; only the last one asks for the vector
    steps = core.runner.steps
    assert [s.num_new_tokens for s in steps] == [[8], [8], [4]]
    assert [s.pooling["e"].finishes for s in steps] == [False, False, True]
    assert all(s.num_samples == [0] and s.sampling == [None] for s in steps)
    assert upd.embedding == [20.0, float(sum(range(20, 40)))]
    assert upd.request.num_output_tokens == 0
    assert core.kv.num_used_blocks == 0 and "e" in core.runner.released
    assert core.prompt_tokens_total == 20 and core.generation_tokens_total == 0


def test_embeddings_beside_generation_leave_its_tokens_alone_and_leak_no_blocks():
    alone = make_core(max_num_batched_tokens=16, max_prefill_tokens_per_step=8)
    alone.add_request(gen_req("g", 10, max_tokens=8))
    expected = run(alone)[1]["g"]

    core = make_core(max_num_batched_tokens=16, max_prefill_tokens_per_step=8)
    core.add_request(gen_req("g", 10, max_tokens=8))
    for i in range(4):
        core.add_request(embed_req(f"e{i}", 6 + 5 * i, start_tok=200 + 30 * i))
    final, tokens = run(core)
    assert tokens["g"] == expected
    assert all(final[f"e{i}"].embedding[0] == 6 + 5 * i for i in range(4))
    mixed = [s for s in core.runner.steps if s.pooling and any(s.num_samples)]
    assert mixed, "embedding prefills never shared a step with generation"
    assert all(s.num_tokens <= 16 for s in core.runner.steps)
    assert core.kv.num_used_blocks == 0
    core.kv.check_invariants()


def test_an_embedding_request_never_takes_speculative_drafts():
    core = make_core()
    r = embed_req("e", 1)
    r.spec_token_ids = [7, 8, 9]
    core.add_request(r)
    core.step()   # admitted with its only token: it is pooled at once
    sched = core.schedules[-1]
    assert [(s.num_new_tokens, s.num_draft_tokens) for s in sched.scheduled] == [(1, 0)]
    assert core.runner.steps[-1].token_ids == [20]
    assert not core.scheduler.requests and core.kv.num_used_blocks == 0


@pytest.mark.parametrize("method, hits", [("last", True), ("mean", False), ("cls", False)])
def test_prefix_cache_serves_last_pooling_only(method, hits):
    core = make_core()
    core.add_request(gen_req("warm", 17, max_tokens=2))
    run(core)
    core.add_request(embed_req("e", 17, method=method))
    final, _ = run(core)
    assert (final["e"].request.num_cached_tokens > 0) is hits
    # mean and cls read every position: their first chunk starts at position 0
    starts = [s.start_positions[s.request_ids.index("e")] for s in core.runner.steps
              if "e" in s.request_ids]
    assert (starts[0] > 0) is hits
    assert final["e"].embedding[0] == 17.0


def test_an_embedding_request_aborted_mid_prefill_frees_its_blocks():
    core = make_core(max_prefill_tokens_per_step=8)
    core.add_request(embed_req("e", 30, method="mean"))
    core.step()
    assert core.kv.num_used_blocks > 0
    upd = core.abort_request("e")
    assert upd is not None and upd.embedding is None
    assert upd.delta.finish_reason == FinishReason.ABORT
    assert core.kv.num_used_blocks == 0 and "e" in core.runner.released
    core.kv.check_invariants()


def test_a_preempted_embedding_request_is_recomputed_from_its_first_token():
    # 6 blocks of 4 tokens: the generation request's decode needs the embedding's blocks
    core = make_core(num_blocks=6, max_num_batched_tokens=8, max_prefill_tokens_per_step=8)
    core.add_request(gen_req("g", 8, max_tokens=8))
    core.step()
    core.add_request(Request("e", list(range(300, 316)), SamplingParams(max_tokens=1),
                             priority=2, arrival_time=1001.0, max_model_len=4096,
                             pooling=PoolingParams(method="mean")))
    final, _ = run(core)
    assert final["e"].request.num_preemptions >= 1
    assert final["e"].embedding == [16.0, float(sum(range(300, 316)))]
    assert core.kv.num_used_blocks == 0


def test_the_runner_must_return_a_vector():
    core = make_core()
    core.runner.execute = lambda step, inner=core.runner.execute: _drop_pooled(inner(step))
    core.add_request(embed_req("e", 5))
    final, _ = run(core)
    assert final["e"].delta.finish_reason == FinishReason.ERROR
    assert final["e"].error is not None and core.kv.num_used_blocks == 0


def _drop_pooled(out):
    out.pooled = {}
    return out


def test_embedding_request_needs_a_resolved_method():
    with pytest.raises(ValueError, match="pooling method"):
        Request("e", [1, 2], SamplingParams(max_tokens=1), pooling=PoolingParams())
    assert embed_req("e", 5).max_total_tokens == 5


def test_pooling_params_validation():
    for bad in ({"method": "max"}, {"dimensions": 0}, {"dimensions": True},
                {"normalize": "yes"}):
        with pytest.raises(ValueError):
            PoolingParams(**bad)
    assert PoolingParams(method="last").needs_every_position is False
    assert PoolingParams(method="cls").needs_every_position is True
