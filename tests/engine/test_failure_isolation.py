"""A runner that raises on one request fails that request alone (no model)."""
from __future__ import annotations

import random

import pytest

from llmserve.engine.core import EngineCore
from llmserve.engine.isolation import isolate_failures
from llmserve.engine.kv.kv_cache_manager import KVCacheManager
from llmserve.engine.output.processor import OutputProcessor
from llmserve.engine.request import Request
from llmserve.engine.scheduler import Scheduler, SchedulerConfig
from llmserve.protocol import RequestFailedError
from llmserve.sampling_params import SamplingParams
from tests.engine.conftest import BLOCK, Clock
from tests.engine.fake_runner import CharTokenizer, FakeRunner

POISON = 7  # a prompt holding this token makes every batch it is in raise


POISONED: set[str] = set()   # ids of requests whose prompt holds POISON (filled by req())


def poison(exc_type=RuntimeError):
    def fail_if(request_id):
        if request_id in POISONED:
            return exc_type(f"cannot run {request_id}")
        return None
    return fail_if


def make(fail_if=None, num_blocks=256, **sched_kw) -> EngineCore:
    kv = KVCacheManager(num_blocks, BLOCK, enable_prefix_caching=True, fingerprint="t")
    extra = {k: sched_kw.pop(k) for k in ("max_loras", "admission_watermark_blocks")
             if k in sched_kw}
    sched = Scheduler(SchedulerConfig(**sched_kw), kv, clock=Clock(), **extra)
    return EngineCore(sched, FakeRunner(fail_if=fail_if), OutputProcessor(CharTokenizer()),
                      check_invariants=True)


def req(rid, prompt, max_tokens=6):
    if POISON in prompt:
        POISONED.add(rid)
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                               temperature=0), max_model_len=4096)


def prompt(i, length=9):
    return [100 + 13 * i + j for j in range(length)]


def run(core, arrivals, max_steps=2000):
    """Add `arrivals[step]` before each step; return tokens, finish reasons and errors."""
    tokens, reasons, errors = {}, {}, {}
    for step in range(max_steps):
        for r in arrivals.get(step, []):
            core.add_request(r)
        if not core.scheduler.requests and step > max(arrivals):
            return tokens, reasons, errors
        for u in core.step():
            rid = u.request.request_id
            tokens.setdefault(rid, []).extend(u.delta.token_ids)
            if u.delta.finish_reason:
                reasons[rid] = u.delta.finish_reason
            if u.error is not None:
                errors[rid] = u.error
    raise AssertionError("did not finish")


def alone(p, max_tokens=6):
    core = make()
    tokens, _, _ = run(core, {0: [req("x", p, max_tokens)]})
    return tokens["x"]


@pytest.mark.parametrize("exc_type,input_error", [(RuntimeError, False), (ValueError, True)])
def test_faulty_request_joining_a_running_batch_fails_alone(exc_type, input_error):
    core = make(poison(exc_type))
    good = [req(f"g{i}", prompt(i), max_tokens=8) for i in range(5)]
    bad = req("bad", prompt(9)[:4] + [POISON] + prompt(9)[4:])
    tokens, reasons, errors = run(core, {0: good[:3], 2: [bad], 3: good[3:]})
    assert reasons["bad"] == "error" and tokens.get("bad", []) == []
    err = errors["bad"]
    assert isinstance(err, RequestFailedError) and err.error_id.startswith("err-")
    assert err.input_error is input_error and err.error_id in str(err)
    for i, g in enumerate(good):
        assert reasons[g.request_id] == "length"
        assert tokens[g.request_id] == alone(prompt(i), 8)
    assert set(errors) == {"bad"}
    assert core.stats().num_step_errors == 1   # one failing step: the culprit is gone after it
    assert core.kv.num_used_blocks == 0
    assert "bad" in core.runner.released


def test_several_culprits_in_one_step():
    core = make(poison())
    reqs = [req(f"r{i}", prompt(i) + ([POISON] if i in (1, 4, 6) else [])) for i in range(8)]
    tokens, reasons, errors = run(core, {0: reqs})
    assert set(errors) == {"r1", "r4", "r6"}
    for i in (0, 2, 3, 5, 7):
        assert tokens[f"r{i}"] == alone(prompt(i))


def test_same_step_prefix_hit_on_a_culprit_is_recomputed():
    # "dep" shares the culprit's first blocks and hits them in the prefix cache in the same
    # step; the culprit never wrote them, so "dep" must be requeued and computed again.
    shared = prompt(1, 3 * BLOCK)
    bad = req("bad", shared + [POISON, 3])
    dep = req("dep", shared + [5, 6, 8])
    core = make(poison())
    seen_hits = []
    orig = core.runner.execute

    def execute(step):
        for rid, start in zip(step.request_ids, step.start_positions):
            if rid == "dep":
                seen_hits.append(start)
        return orig(step)

    core.runner.execute = execute
    core.add_request(bad)
    core.add_request(dep)
    first = core.step()
    assert [(u.request.request_id, u.delta.finish_reason) for u in first] == [("bad", "error")]
    # nothing the failed step was to write stays in the prefix cache, and nothing leaked
    assert all(core.kv.pool.lookup(h) is None for h in bad.block_hashes)
    assert core.kv.num_used_blocks == 0 and dep.num_computed_tokens == 0
    tokens, reasons, errors = run(core, {0: []})
    assert seen_hits[0] == 3 * BLOCK       # it did hit the culprit's blocks first
    assert seen_hits[1] == 0               # and was recomputed from scratch after requeue
    assert tokens["dep"] == alone(shared + [5, 6, 8]) and reasons["dep"] == "length"
    assert core.scheduler.num_preemptions == 0


def test_isolate_failures_finds_exactly_the_culprits():
    rng = random.Random(0)
    for _ in range(50):
        n = rng.randint(1, 40)
        bad = set(rng.sample(range(n), rng.randint(0, min(3, n))))
        calls = []

        def run_subset(items):
            calls.append(list(items))
            if bad & set(items):
                raise RuntimeError("boom")
            return list(items)

        try:
            run_subset(list(range(n)))
            continue
        except RuntimeError as exc:
            first = exc
        out = isolate_failures(list(range(n)), run_subset, first)
        ran = sorted(i for items, res in out.results for i in res)
        assert sorted(i for i, _ in out.failed) == sorted(bad)
        assert ran == sorted(set(range(n)) - bad)
        assert out.runs <= 2 * len(bad) * max(1, n.bit_length()) + 1


def test_isolate_failures_defers_dependents_of_culprits():
    # item 3 reads what item 1 writes: with 1 failing, 3 is not run
    def depends_on(item, lost):
        return item == 3 and 1 in lost

    def run_subset(items):
        if 1 in items:
            raise RuntimeError("boom")
        return items

    out = isolate_failures([0, 1, 2, 3, 4], run_subset, RuntimeError("boom"), depends_on)
    assert [i for i, _ in out.failed] == [1]
    assert out.deferred == [3]
    assert sorted(i for items, _ in out.results for i in items) == [0, 2, 4]


def test_merged_outputs_keep_prompt_logprobs_and_subsets_count_prefill_only():
    from llmserve.engine.scheduler import ScheduledRequest, SchedulerOutput
    from llmserve.engine.step_isolation import merge_outputs, subset
    from llmserve.engine.step_types import StepOutput

    a = StepOutput(request_ids=["a"], token_ids=[[1]],
                   prompt_logprobs={"a": (1, [(-0.5, [(3, -0.5)])])})
    b = StepOutput(request_ids=["b"], token_ids=[[2, 3]], logprobs=[[-0.1, -0.2]])
    merged = merge_outputs([a, b])
    assert merged.request_ids == ["a", "b"] and merged.token_ids == [[1], [2, 3]]
    assert merged.prompt_logprobs == {"a": (1, [(-0.5, [(3, -0.5)])])}
    assert merged.logprobs == [None, [-0.1, -0.2]]

    params = SamplingParams(max_tokens=4)
    decoding = Request("d", list(range(10)), params)     # 10 tokens, 9 computed: decode
    prefilling = Request("p", list(range(20)), params)   # a chunk of 8 of 20 prompt tokens
    items = [ScheduledRequest(decoding, start=9, num_new_tokens=4, num_draft_tokens=3),
             ScheduledRequest(prefilling, start=0, num_new_tokens=8)]
    sched = SchedulerOutput(step=3, scheduled=items, num_batched_tokens=12,
                            num_prefill_tokens=8)
    assert subset(sched, items).num_prefill_tokens == 8
    assert subset(sched, items[:1]).num_prefill_tokens == 0
    assert subset(sched, items[:1]).num_batched_tokens == 4


def test_isolate_failures_with_named_culprits_reruns_the_rest_once():
    # the error names items 2 and 5 (a sampler that saw NaN logits in their rows): they
    # fail without a search, the others run again exactly once, 4 still waits on 2
    calls = []

    def run_subset(items):
        calls.append(list(items))
        if {2, 5} & set(items):
            raise RuntimeError("boom")
        return list(items)

    def depends_on(item, lost):
        return item == 4 and 2 in lost

    first = RuntimeError("rows 2 and 5 are NaN")
    out = isolate_failures(list(range(8)), run_subset, first, depends_on, known_culprits=[2, 5])
    assert [i for i, _ in out.failed] == [2, 5] and all(e is first for _, e in out.failed)
    assert out.deferred == [4]
    assert calls == [[0, 1, 3, 6, 7]] and out.runs == 1
    # a culprit the error did not name is still found by the search
    out = isolate_failures(list(range(8)), run_subset, first, known_culprits=[2])
    assert sorted(i for i, _ in out.failed) == [2, 5]
    assert sorted(i for items, _ in out.results for i in items) == [0, 1, 3, 4, 6, 7]
