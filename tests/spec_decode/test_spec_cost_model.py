"""The speculation cost model (no torch): step times by row count, interpolated and
extrapolated; drafts planned only while they raise the step's expected tokens per second;
in the engine, speculation that stays on where steps are weight-bound and goes off where
every row costs."""
from __future__ import annotations

import pytest

from llmserve.spec_decode.cost_model import (
    DraftCandidate,
    StepCostModel,
    expected_accepted,
    plan_drafts,
    uniform_draft_length,
)
from tests.engine.conftest import Clock
from tests.spec_decode.test_spec_decode_engine import PROMPTS, req, run, spec_core


def test_cost_is_measured_interpolated_and_extrapolated():
    m = StepCostModel()
    assert m.cost(4) is None
    m.record(4, 0.010)
    assert m.cost(1) == m.cost(40) == 0.010          # one point: flat
    m.record(8, 0.020)
    assert m.cost(6) == pytest.approx(0.015)
    assert m.cost(16) == pytest.approx(0.040)        # the slope of the two nearest
    assert m.cost(2) == pytest.approx(0.005)
    m.record(8, 0.040)                               # a moving average, not the last value
    assert 0.020 < m.cost(8) < 0.040
    m2 = StepCostModel()
    m2.record(2, 0.02)
    m2.record(4, 0.01)                               # noise: never a falling cost
    assert m2.cost(9) == pytest.approx(0.01)
    assert m2.cost(1) >= 0.25 * 0.02


def test_plan_keeps_drafts_where_rows_are_cheap_and_drops_them_where_they_cost():
    cheap, dear = StepCostModel(), StepCostModel()
    for rows in (1, 8, 16, 48):
        cheap.record(rows, 0.010 + 0.0001 * rows)    # bound by reading the weights
        dear.record(rows, 0.001 * rows)              # bound by compute
    cands = [DraftCandidate(4, 0.9), DraftCandidate(4, 0.25), DraftCandidate(4, 0.05)]
    # drafts accepted 5% of the time do not pay even there
    assert plan_drafts(cheap, 8, cands) == [4, 4, 0]
    # every row costs as much as a token: only drafts accepted nearly always pay
    assert plan_drafts(dear, 8, cands) == [0, 0, 0]
    assert plan_drafts(dear, 8, [DraftCandidate(4, 1.0)]) == [0]
    mixed = StepCostModel()
    for rows in (8, 12, 16, 40):
        mixed.record(rows, 0.010 if rows <= 12 else 0.0009 * rows)
    # four rows are nearly free above 8, more are not: the best candidate gets them
    assert plan_drafts(mixed, 8, cands)[0] == 4 and plan_drafts(mixed, 8, cands)[2] == 0
    assert plan_drafts(StepCostModel(), 8, cands) == [4, 4, 4]   # nothing measured yet


@pytest.mark.parametrize("fixed, per_row, drafted", [(0.01, 0.0005, True), (0.0, 0.02, False)])
def test_engine_speculates_only_where_its_steps_say_it_pays(fixed, per_row, drafted):
    clock = Clock()
    core = spec_core(clock=clock)
    core.spec.costs.explore_every = 0
    execute = core.runner.execute

    def timed(step):   # a step of R rows takes fixed + per_row * R seconds
        clock.t += fixed + per_row * sum(step.num_new_tokens)
        return execute(step)

    core.runner.execute = timed
    ref = run(spec_core(), [req(f"r{i}", p, max_tokens=40) for i, p in enumerate(PROMPTS)])
    got = run(core, [req(f"r{i}", p, max_tokens=40) for i, p in enumerate(PROMPTS)])
    assert got == ref
    assert core.spec.costs.num_measured > 1
    late = [s.num_draft_tokens for sch in core.schedules[len(core.schedules) // 2:]
            for s in sch.scheduled]
    assert (sum(late) > 0) == drafted, late


def test_one_draft_length_for_the_step_where_rows_are_cheap_and_none_where_they_cost():
    assert expected_accepted(0.5, 3) == pytest.approx(0.5 + 0.25 + 0.125)
    assert expected_accepted(1.0, 5) == 5 and expected_accepted(0.0, 5) == 0
    cheap, dear = StepCostModel(), StepCostModel()
    for rows in (4, 8, 16, 32, 64):
        cheap.record(rows, 0.010 + 0.0001 * rows)
        dear.record(rows, 0.001 * rows)
    lengths, acceptances = [7, 3, 0, 5], [0.9, 0.6, 0.0, 0.8]
    # weight-bound steps: the longest draft pays (its expected tokens outgrow the rows)
    assert uniform_draft_length(cheap, lengths, acceptances) == 7
    # compute-bound: every padded row costs as much as a token, so no drafts at all
    assert uniform_draft_length(dear, lengths, acceptances) == 0
    assert uniform_draft_length(StepCostModel(), lengths, acceptances) == 7   # unmeasured


def test_a_decode_step_gives_every_sequence_the_same_number_of_drafts():
    """n-gram drafts differ in length from sequence to sequence; in a decode step of
    several sequences each verifies the same number (cut or filled), so the runner can
    run it as one compiled verify graph, and the tokens are those of plain decoding."""
    clock = Clock()
    core = spec_core(clock=clock)
    core.spec.costs.explore_every = 0
    execute = core.runner.execute

    def timed(step):   # weight-bound: rows are nearly free
        clock.t += 0.01 + 0.0001 * sum(step.num_new_tokens)
        return execute(step)

    core.runner.execute = timed
    ref = run(spec_core(), [req(f"r{i}", p, max_tokens=40) for i, p in enumerate(PROMPTS)])
    got = run(core, [req(f"r{i}", p, max_tokens=40) for i, p in enumerate(PROMPTS)])
    assert got == ref
    uneven = evened = 0
    for sch in core.schedules:
        rows = sch.scheduled
        decode_only = all(s.num_new_tokens - s.num_draft_tokens == 1 for s in rows)
        if not decode_only or len(rows) < 2 or not any(s.num_draft_tokens for s in rows):
            continue
        longest = max(s.num_draft_tokens for s in rows)
        # drafts never pass max_tokens: a sequence with less room than that is short
        room = [s.request.max_total_tokens - (s.start + 1) - 1 for s in rows]
        counts = {s.num_draft_tokens for s, r in zip(rows, room) if r >= longest}
        evened += 1
        uneven += len(counts) > 1
    assert evened > 5 and uneven == 0, (evened, uneven)
    assert core.spec.stats.proposed_tokens > 0


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_steps_that_prefill_verify_no_drafts(method):
    """A step that prefills runs eagerly: n-gram and suffix drafts wait for the decode-only
    steps around it (two sequences at a time, so each end admits a waiting request)."""
    ref = run(spec_core(method=method, max_num_seqs=2),
              [req(f"r{i}", p, max_tokens=30) for i, p in enumerate(PROMPTS)])
    core = spec_core(method=method, max_num_seqs=2)
    got = run(core, [req(f"r{i}", p, max_tokens=30) for i, p in enumerate(PROMPTS)])
    assert got == ref
    prefilling = [sch for sch in core.schedules
                  if any(s.num_new_tokens - s.num_draft_tokens > 1 for s in sch.scheduled)]
    assert len(prefilling) >= len(PROMPTS) - 1   # the first step prefills two
    assert all(s.num_draft_tokens == 0 for sch in prefilling for s in sch.scheduled)
    assert core.spec.stats.accepted_tokens > 20


def test_a_waiting_request_that_does_not_fit_does_not_stop_speculation():
    """The queue holds a request whose KV does not fit the pool: the scheduler says its
    admission is blocked, and the running request keeps drafting (no prefill is coming)."""
    core = spec_core(num_blocks=20)   # 80 tokens: each request fits alone, not both
    core.add_request(req("run", PROMPTS[0] * 5, max_tokens=30))
    core.step()
    core.add_request(req("big", list(range(40, 80)), max_tokens=30))
    drafted = 0
    for _ in range(6):
        core.step()
        assert core.scheduler.waiting and core.scheduler.admission_blocked
        drafted += sum(s.num_draft_tokens for s in core.schedules[-1].scheduled)
    assert drafted > 0
