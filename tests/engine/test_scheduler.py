"""Scheduler tests with a fake runner: no model, no torch."""
from __future__ import annotations

import random

import pytest

from llmserve.engine.request import Request, RequestStatus
from llmserve.sampling_params import SamplingParams
from tests.engine.conftest import make_core


def req(rid, n_prompt, max_tokens=8, priority=1, arrival=1000.0, start_tok=20, salt=None):
    return Request(rid, list(range(start_tok, start_tok + n_prompt)),
                   SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0),
                   priority=priority, arrival_time=arrival, cache_salt=salt, max_model_len=4096)


def run_to_end(core, max_steps=10_000):
    finished = {}
    for _ in range(max_steps):
        if not core.scheduler.requests:
            return finished
        for u in core.step():
            if u.delta.finish_reason:
                finished[u.request.request_id] = u.request
    raise AssertionError("did not finish")


def test_budget_respected_every_step():
    core = make_core(max_num_batched_tokens=32, max_num_seqs=8)
    for i in range(10):
        core.add_request(req(f"r{i}", 5 + 7 * i, max_tokens=6))
    while core.scheduler.requests:
        core.step()
        s = core.schedules[-1]
        assert s.num_batched_tokens <= 32
        assert len(s.scheduled) <= 8
        assert sum(x.num_new_tokens for x in s.scheduled) == s.num_batched_tokens


def test_chunked_prefill_interleaves_with_decodes():
    core = make_core(max_num_batched_tokens=16, max_num_seqs=8)
    core.add_request(req("short", 4, max_tokens=20))
    core.step()  # short prefilled, sampled its first token
    core.add_request(req("long", 100, max_tokens=2, start_tok=500))
    chunks = []
    for _ in range(8):
        core.step()
        s = core.schedules[-1]
        kinds = {x.request.request_id: x.num_new_tokens for x in s.scheduled}
        assert kinds.get("short") == 1            # the decode runs in every step
        if "long" in kinds:
            chunks.append(kinds["long"])          # ...beside a chunk of the long prompt
    assert chunks[:7] == [15] * 6 + [10]


def test_max_prefill_tokens_per_step_caps_prefill():
    core = make_core(max_num_batched_tokens=64, max_prefill_tokens_per_step=8)
    core.add_request(req("a", 40))
    core.add_request(req("b", 40))
    core.step()
    s = core.schedules[-1]
    assert s.num_prefill_tokens <= 8


def test_default_prefill_cap_spreads_a_burst_over_steps_beside_its_decodes():
    """32 prompts of 130 tokens at once: by default each step takes at most 512 prompt
    tokens (the burst's first tokens come out a few requests at a time, not 15 at once),
    and from the second step on the requests already started decode in every step."""
    core = make_core(num_blocks=4096, max_num_seqs=64)   # default budget and cap
    assert core.scheduler.config.max_prefill_tokens_per_step == 512
    for i in range(32):
        core.add_request(req(f"r{i}", 130, max_tokens=16, start_tok=1000 * i))
    started: set[str] = set()
    while any(r.num_computed_tokens < r.num_prompt_tokens
              for r in core.scheduler.requests.values()):
        core.step()
        s = core.schedules[-1]
        assert s.num_prefill_tokens <= 512
        decodes = {x.request.request_id for x in s.scheduled if x.num_new_tokens == 1}
        assert decodes == started              # every started request decodes each step
        started = {rid for rid, r in core.scheduler.requests.items()
                   if r.num_computed_tokens >= r.num_prompt_tokens}
    assert len(core.schedules) == -(-32 * 130 // 512)    # 9 steps of prompt tokens
    assert core.scheduler.num_preemptions == 0


def test_prefill_cap_zero_leaves_only_the_budget():
    core = make_core(num_blocks=1024, max_num_batched_tokens=2048, max_num_seqs=64,
                     max_prefill_tokens_per_step=0)
    for i in range(32):
        core.add_request(req(f"r{i}", 130, max_tokens=4, start_tok=1000 * i))
    core.step()
    assert core.schedules[-1].num_prefill_tokens == 2048


def test_negative_prefill_cap_is_refused():
    from llmserve.config import SchedulerConfig

    with pytest.raises(ValueError, match="max_prefill_tokens_per_step"):
        SchedulerConfig(max_prefill_tokens_per_step=-1)


def test_priority_order_and_aging(clock):
    core = make_core(max_num_seqs=1, clock=clock, aging_rate=0.1)
    core.add_request(req("batch-old", 4, priority=2, arrival=clock.t - 5))
    core.add_request(req("interactive", 4, priority=0, arrival=clock.t))
    core.step()
    assert [x.request.request_id for x in core.schedules[-1].scheduled] == ["interactive"]
    run_to_end(core)
    # aging: a batch request that waited 30 s (2 - 3 = -1) beats a fresh interactive one (0)
    core2 = make_core(max_num_seqs=1, clock=clock, aging_rate=0.1)
    core2.add_request(req("batch-aged", 4, priority=2, arrival=clock.t - 30))
    core2.add_request(req("interactive", 4, priority=0, arrival=clock.t))
    core2.step()
    assert [x.request.request_id for x in core2.schedules[-1].scheduled] == ["batch-aged"]


def test_preemption_picks_lowest_priority_latest_arrival(clock):
    # 6 blocks of 4 tokens; three requests of 7-token prompts need 2 blocks each, then grow
    core = make_core(num_blocks=6, clock=clock, max_num_seqs=8)
    core.add_request(req("hi", 7, max_tokens=10, priority=0, arrival=clock.t - 3, start_tok=100))
    core.add_request(req("lo-early", 7, max_tokens=10, priority=2, arrival=clock.t - 2,
                         start_tok=200))
    core.add_request(req("lo-late", 7, max_tokens=10, priority=2, arrival=clock.t - 1,
                         start_tok=300))
    core.scheduler.admission_watermark_blocks = 0
    core.step()
    assert core.kv.num_free_blocks == 0
    preempted = []
    for _ in range(3):  # soon every request needs a third block
        core.step()
        preempted += [r.request_id for r in core.schedules[-1].preempted]
        if preempted:
            break
    assert preempted[0] == "lo-late"
    assert core.scheduler.num_preemptions >= 1
    assert core.scheduler.requests["lo-late"].status is RequestStatus.PREEMPTED
    run_to_end(core)


def test_preempted_request_output_same_as_unpreempted():
    def outputs(num_blocks):
        core = make_core(num_blocks=num_blocks, max_num_seqs=8)
        for i in range(4):
            core.add_request(req(f"r{i}", 6 + i, max_tokens=12, start_tok=30 + i))
        done = run_to_end(core)
        return {k: v.output_token_ids for k, v in done.items()}, core.scheduler.num_preemptions

    ample, p0 = outputs(64)
    tight, p1 = outputs(8)
    assert p0 == 0 and p1 > 0
    assert ample == tight


@pytest.mark.parametrize("when", ["waiting", "mid_prefill", "decoding"])
def test_abort_from_each_state_frees_every_block(when):
    core = make_core(max_num_batched_tokens=8)
    core.add_request(req("other", 5, max_tokens=30))
    core.step()
    used_before = core.kv.num_used_blocks
    core.add_request(req("victim", 30, max_tokens=30))
    if when == "mid_prefill":
        core.step()
        v = core.scheduler.requests["victim"]
        assert 0 < v.num_computed_tokens < 30
    elif when == "decoding":
        for _ in range(6):
            core.step()
        assert core.scheduler.requests["victim"].num_output_tokens > 0
    upd = core.abort_request("victim")
    assert upd is not None and upd.delta.finish_reason == "abort"
    assert core.kv.blocks_of("victim") == []
    assert "victim" in core.runner.released
    core.kv.check_invariants()
    # caching keeps the freed blocks hashed but free: used count is back to the other request's
    assert core.kv.num_used_blocks == len(core.kv.blocks_of("other"))
    assert core.kv.num_used_blocks >= used_before
    assert core.abort_request("victim") is None


def test_request_too_big_for_pool_rejected():
    core = make_core(num_blocks=4)
    with pytest.raises(ValueError, match="whole pool"):
        core.add_request(req("big", 10, max_tokens=10))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_randomized_invariants_with_arrivals_aborts_and_tiny_pool(seed):
    rng = random.Random(seed)
    core = make_core(num_blocks=12, max_num_batched_tokens=rng.choice([6, 16, 32]),
                     max_num_seqs=rng.choice([2, 4, 8]), caching=rng.random() < 0.7)
    live = set()
    n = 0
    for _ in range(400):
        if rng.random() < 0.3 and n < 60:
            rid = f"r{n}"
            n += 1
            core.add_request(req(rid, rng.randint(1, 20), max_tokens=rng.randint(1, 20),
                                 priority=rng.randint(0, 2), start_tok=rng.choice([20, 20, 50])))
            live.add(rid)
        if live and rng.random() < 0.08:
            victim = rng.choice(sorted(live))
            core.abort_request(victim)
        for u in core.step():
            assert u.request.num_tokens <= u.request.max_total_tokens
        core.kv.check_invariants()
        live = {r for r in live if r in core.scheduler.requests}
    run_to_end(core)
    core.kv.check_invariants()
    assert core.kv.num_used_blocks == 0


def test_deadline_and_queue_deadline_end_requests_and_free_kv(clock):
    import time as _time

    core = make_core(max_num_seqs=1, clock=clock)
    running = req("running", 6, max_tokens=100)
    queued = req("queued", 6, max_tokens=5, start_tok=400)
    now = _time.time()
    running.deadline = now + 3600
    queued.queue_deadline = now - 1          # already past: it never gets scheduled
    core.add_request(running)
    core.add_request(queued)
    core.step()
    ups = core.expire_deadlines(_time.time())
    assert [(u.request.request_id, u.delta.finish_reason) for u in ups] == [("queued", "queue_timeout")]
    running.deadline = now - 1
    ups = core.expire_deadlines(_time.time())
    assert [(u.request.request_id, u.delta.finish_reason) for u in ups] == [("running", "timeout")]
    assert core.kv.num_used_blocks == 0 and not core.scheduler.requests
    core.kv.check_invariants()


def test_watermark_never_blocks_a_request_that_fits_an_idle_pool():
    core = make_core(num_blocks=4, admission_watermark_blocks=1)
    core.add_request(req("big", 15, max_tokens=1))     # needs all 4 blocks
    core.add_request(req("next", 3, max_tokens=1, start_tok=300))
    done = run_to_end(core, max_steps=50)
    assert set(done) == {"big", "next"}


def test_no_priority_inversion_when_blocks_run_out(clock):
    core = make_core(num_blocks=6, max_num_batched_tokens=8, clock=clock)
    low = req("low", 2, max_tokens=16, priority=2)
    core.add_request(low)
    core.step()
    high = req("high", 17, max_tokens=4, priority=0, start_tok=100)
    core.add_request(high)
    for _ in range(40):
        if not core.scheduler.requests:
            break
        core.step()
        s = core.schedules[-1]
        assert high not in s.preempted or not any(x.request is low for x in s.scheduled)
    assert high.is_finished
