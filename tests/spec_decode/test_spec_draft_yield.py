"""The check on the speculation plan (no torch): drafted steps of several sequences that do
not realize their gain turn drafting off at that batch size; shadow drafts (planned, never
verified) or retries turn it on again; greedy tokens never change."""
from __future__ import annotations

import pytest

from llmserve.engine.request import RequestStatus
from llmserve.spec_decode.cost_model import (
    BATCH_GAIN,
    REOPEN_GAIN,
    SHADOW_SAMPLES,
    DraftYield,
    StepCostModel,
)
from llmserve.spec_decode.shadow_drafts import ShadowDrafts
from tests.engine.conftest import Clock
from tests.spec_decode.test_spec_decode_engine import PROMPTS, plain_core, req, run, spec_core


def test_drafted_steps_that_do_not_pay_close_their_batch_size_and_its_neighbours():
    y = DraftYield()
    assert y.is_open(8) and y.gain(8) is None
    y.record(8, tokens=12, seconds=0.012, plain_seconds=0.008)    # 12 tokens for 1.5x time
    assert y.gain(8) == pytest.approx(1.0)
    assert not y.is_open(8)
    # sizes not measured take the nearest measured one: a batch passing through 7 or 9
    # sequences does not draft to learn what 8 showed
    assert not y.is_open(7) and not y.is_open(12)
    y.record(2, tokens=6, seconds=0.006, plain_seconds=0.005)     # 6 tokens, 1.2x time
    assert y.is_open(2) and y.is_open(3) and not y.is_open(6)
    # one sequence is never gated: its own acceptance average decides
    y.record(1, tokens=1, seconds=0.010, plain_seconds=0.005)
    assert y.is_open(1)
    # a gain of 1 + BATCH_GAIN keeps drafting on; the average moves with each step
    y2 = DraftYield()
    y2.record(4, tokens=int(4 * (1 + BATCH_GAIN) * 100), seconds=1.0, plain_seconds=0.01)
    assert y2.is_open(4)
    for _ in range(10):
        y2.record(4, tokens=4, seconds=0.02, plain_seconds=0.01)   # half the rate
    assert not y2.is_open(4)


def test_a_closed_size_is_retried_after_a_wait_that_doubles():
    y = DraftYield(retry_after=4, max_retry_after=16)
    y.record(8, tokens=8, seconds=0.02, plain_seconds=0.01)
    allowed = [s for s in range(100) if y.allows(8, s)]
    # closed at step 0: retries after 4, then 8, then 16 steps, never more apart
    assert allowed[:4] == [4, 12, 28, 44] and allowed[4] - allowed[3] == 16
    assert not any(y.allows(8, s, retry=False) for s in range(100, 200))
    y.record(8, tokens=400, seconds=0.02, plain_seconds=0.01)     # drafting pays again
    assert y.allows(8, 200) and y.allows(8, 201)
    with pytest.raises(ValueError):
        DraftYield(retry_after=0)


def test_shadow_estimates_reopen_a_closed_size_only_when_enough_of_them_pay():
    """A shadow step is priced with what a draft row cost the drafted steps of its size:
    here 4 drafts doubled a 4-sequence step (a draft row as dear as a plain row), so a
    shadow step of 4 sequences and 4 drafts costs 8 plain rows."""
    y = DraftYield()
    y.record(4, tokens=4, seconds=0.02, plain_seconds=0.01, rows=8)
    assert not y.is_open(4)
    good = dict(rows=8, tokens=int(8 * (1 + REOPEN_GAIN)) + 1)
    poor = dict(rows=8, tokens=5)
    for _ in range(SHADOW_SAMPLES - 1):
        y.record_shadow(4, **good)
        assert not y.is_open(4)                                    # not yet enough samples
    y.record(2, tokens=2, seconds=0.02, plain_seconds=0.01, rows=4)
    y.record(6, tokens=6, seconds=0.02, plain_seconds=0.01, rows=12)
    y.record_shadow(4, **good)
    assert y.is_open(4)
    # what pays at 4 sequences pays at fewer: the older verdict at 2 is dropped, not 6's
    assert y.is_open(2) and y.is_open(3) and not y.is_open(6)
    # closed again: a few lucky estimates among poor ones do not reopen it
    for _ in range(5):
        y.record(4, tokens=4, seconds=0.02, plain_seconds=0.01, rows=8)
    assert not y.is_open(4)
    for i in range(4 * SHADOW_SAMPLES):
        y.record_shadow(4, **(good if i % 4 == 0 else poor))
    assert not y.is_open(4)
    # the same matches are worth more where draft rows cost less than plain rows
    cheap = DraftYield()
    cheap.record(4, tokens=4, seconds=0.012, plain_seconds=0.01, rows=8)   # 0.2 a row
    for _ in range(SHADOW_SAMPLES):
        cheap.record_shadow(4, **poor)                             # 5 / 4.8 = 1.04
    assert not cheap.is_open(4)
    for _ in range(SHADOW_SAMPLES):
        cheap.record_shadow(4, rows=8, tokens=7)                   # 7 / 4.8 = 1.46
    assert cheap.is_open(4)


def test_a_shadow_draft_counts_the_tokens_the_sequence_then_generates():
    sh = ShadowDrafts()
    sh.start(seqs=3, rows=12, drafts={"a": ([5, 6, 7], 10), "b": ([1, 2], 4), "c": ([], 9)})
    assert sh.following
    with pytest.raises(RuntimeError):
        sh.start(2, 4, {"a": ([1], 0)})
    assert sh.observe("a", 10, 5) is None and sh.observe("a", 11, 6) is None
    assert sh.observe("zz", 3, 1) is None                          # not followed
    assert sh.observe("a", 12, 9) is None                          # a mismatch: a answers 2
    step = sh.observe("b", 5, 1)                                   # skipped a position: 0
    # c had no draft, so the step waited for a and b only
    assert step is not None and (step.seqs, step.rows, step.matched) == (3, 12, 2)
    assert not sh.following
    sh2 = ShadowDrafts()
    sh2.start(seqs=2, rows=8, drafts={"a": ([5, 6, 7], 10), "b": ([1, 2], 4)})
    assert sh2.observe("b", 4, 1) is None and sh2.observe("b", 5, 2) is None   # all of b
    step = sh2.drop("a")                                           # a ended: 0 matched
    assert step is not None and (step.seqs, step.rows, step.matched) == (2, 8, 2)
    sh3 = ShadowDrafts()
    sh3.start(seqs=2, rows=4, drafts={"a": ([], 1)})
    assert not sh3.following                                       # no draft: nothing to follow


def _timed(core, clock, per_step):
    execute = core.runner.execute

    def timed(step):
        clock.t += per_step(sum(step.num_new_tokens))
        return execute(step)

    core.runner.execute = timed


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_the_engine_stops_drafting_where_drafted_steps_do_not_pay(method):
    """The plan is skipped at every step (so only the realized gain can stop drafts) and a
    step costs as much per row as a token is worth: drafting several sequences stops."""
    prompts = PROMPTS * 2
    ref = run(plain_core(), [req(f"r{i}", p, max_tokens=60) for i, p in enumerate(prompts)])
    clock = Clock()
    core = spec_core(method=method, clock=clock)
    core.spec.costs.explore_every = 1
    _timed(core, clock, lambda rows: 0.001 * rows)
    got = run(core, [req(f"r{i}", p, max_tokens=60) for i, p in enumerate(prompts)])
    assert got == ref
    several = [sch for sch in core.schedules if len(sch.scheduled) >= 2
               and all(s.num_new_tokens - s.num_draft_tokens == 1 for s in sch.scheduled)]
    drafted = [any(s.num_draft_tokens for s in sch.scheduled) for sch in several]
    assert len(several) > 40 and any(drafted[:10])
    assert sum(drafted[len(drafted) // 2:]) == 0, drafted
    assert core.spec.yields.gain(len(PROMPTS)) < 1 + BATCH_GAIN


def test_the_engine_keeps_drafting_where_drafted_steps_pay():
    clock = Clock()
    core = spec_core(clock=clock)
    core.spec.costs.explore_every = 1
    _timed(core, clock, lambda rows: 0.01 + 0.0001 * rows)      # bound by the weights
    run(core, [req(f"r{i}", p, max_tokens=60) for i, p in enumerate(PROMPTS * 2)])
    late = [s.num_draft_tokens for sch in core.schedules[len(core.schedules) // 2:]
            for s in sch.scheduled]
    assert sum(late) > 0 and core.spec.yields.is_open(len(PROMPTS))


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_shadow_drafts_turn_drafting_back_on_without_verifying_a_draft(method):
    """Drafting starts closed at every batch size (a poor realized gain recorded), on a
    machine where drafts are cheap: shadow drafts, never verified, measure that they would
    pay, and drafting resumes. The tokens are those of plain decoding throughout."""
    prompts = PROMPTS * 2
    ref = run(plain_core(), [req(f"r{i}", p, max_tokens=200) for i, p in enumerate(prompts)])
    clock = Clock()
    core = spec_core(method=method, clock=clock)
    spec = core.spec
    costs = StepCostModel()
    for rows in (1, 2, 5, 10, 20, 40, 60):
        costs.record(rows, 0.01 + 0.0001 * rows)
    spec.costs = costs
    for b in range(2, 11):
        # closed, with draft rows measured at a tenth of a plain row
        spec.yields.record(b, tokens=b, seconds=0.02, plain_seconds=0.01, rows=11 * b)
    assert not any(spec.yields.is_open(b) for b in range(2, 11))
    _timed(core, clock, lambda rows: 0.01 + 0.0001 * rows)
    got = run(core, [req(f"r{i}", p, max_tokens=200) for i, p in enumerate(prompts)])
    assert got == ref
    drafted = [i for i, sch in enumerate(core.schedules) if len(sch.scheduled) >= 2
               and any(s.num_draft_tokens for s in sch.scheduled)]
    # the first steps verify nothing (closed; shadows only), later ones draft again
    assert drafted and drafted[0] > SHADOW_SAMPLES
    assert len(drafted) > 10 and spec.stats.accepted_tokens > 0


def test_one_lucky_estimate_does_not_carry_the_shadow_average():
    """The shadow average is a plain mean of its first samples: a first estimate of 1.6x
    followed by seven of 1.0x is 1.075x, not enough to reopen."""
    y = DraftYield()
    y.record(4, tokens=4, seconds=0.02, plain_seconds=0.01, rows=8)
    y.record_shadow(4, rows=8, tokens=int(8 * 1.6))
    for _ in range(SHADOW_SAMPLES - 1):
        y.record_shadow(4, rows=8, tokens=8)
    assert not y.is_open(4)


def test_a_retried_size_needs_the_wider_margin_to_open_and_forgets_its_neighbours_evidence():
    y = DraftYield()
    y.record(8, tokens=8, seconds=0.02, plain_seconds=0.01, rows=16)   # 0.5x: closed
    for _ in range(6):
        y.record(8, tokens=int(8 * 1.1 * 2), seconds=0.02, plain_seconds=0.01)
    assert not y.is_open(8)            # 1.1x retries: above the closing bar, below reopening
    good = dict(rows=14, tokens=int(14 * (1 + REOPEN_GAIN)) + 1)
    for _ in range(SHADOW_SAMPLES - 1):
        y.record_shadow(7, **good)     # 7 is closed through its neighbour 8
    for _ in range(6):
        y.record(8, tokens=40, seconds=0.02, plain_seconds=0.01)   # 2.5x: open again
    assert y.is_open(8) and y.is_open(7)
    y.record(8, tokens=8, seconds=0.2, plain_seconds=0.01)         # closed again at once
    assert not y.is_open(7)
    y.record_shadow(7, **good)         # the shadows before the reopening no longer count
    assert not y.is_open(7)


def test_a_shadow_sequence_left_out_of_a_step_answers_at_once():
    """A request of the followed shadow step that a step does not schedule (preempted,
    or left out) answers with what it matched, so the shadow step does not hang."""
    from types import SimpleNamespace

    sh = ShadowDrafts()
    sh.start(2, 6, {"a": ([1, 2], 5), "b": ([3], 7)})
    b = SimpleNamespace(request_id="b", num_tokens=7, status=RequestStatus.RUNNING)
    step = sh.observe_step([b], {"b": [3]})
    assert step is not None and step.matched == 1
    assert not sh.following


def test_a_reopening_that_does_not_pay_makes_the_next_need_more():
    """Shadows promised 1.5x, the drafted steps that followed gave 0.875x: the shadows
    are trusted at 0.875 / 1.5, and the same estimate no longer reopens."""
    y = DraftYield()
    y.record(4, tokens=4, seconds=0.02, plain_seconds=0.01, rows=8)      # closed
    for _ in range(SHADOW_SAMPLES):
        y.record_shadow(4, rows=8, tokens=12)                            # 12 / 8 = 1.5x
    assert y.is_open(4) and y.gain(4) is None      # judged afresh by its drafted steps
    y.record(4, tokens=7, seconds=0.02, plain_seconds=0.01, rows=8)      # 0.875x
    assert not y.is_open(4) and y.shadow_trust == pytest.approx(0.875 / 1.5)
    for _ in range(3 * SHADOW_SAMPLES):
        y.record_shadow(4, rows=8, tokens=12)
    assert not y.is_open(4)
    for _ in range(2 * SHADOW_SAMPLES):
        y.record_shadow(4, rows=8, tokens=24)              # 3x (1.75x trusted) still does
    assert y.is_open(4)


def test_with_drafting_off_every_output_still_joins_the_suffix_cache():
    """Every batch size closed and no shadow step due: requests that never drafted still
    leave their outputs in suffix decoding's global tree."""
    core = spec_core(method="suffix")
    spec = core.spec
    for b in range(2, 16):
        spec.yields.record(b, tokens=b, seconds=0.02, plain_seconds=0.01, rows=2 * b)
    spec._next_shadow = 10**9
    run(core, [req(f"r{i}", p, max_tokens=30) for i, p in enumerate(PROMPTS * 3)])
    assert spec.proposer.num_cached_requests == len(PROMPTS) * 3
