"""Failure isolation on a real (tiny) model: the issue's three triggers, injected past
validation into a running batch, fail alone; everyone else gets the tokens it gets alone."""
from __future__ import annotations

import asyncio
import dataclasses

import pytest

from llmserve import LLM, SamplingParams
from llmserve.async_llm import AsyncLLM
from llmserve.llm import merge_delta
from llmserve.protocol import RequestFailedError, RequestOutput
from tests.model.tiny_checkpoints import make_tiny_checkpoint

PROMPTS = [list(range(10 + 7 * i, 10 + 7 * i + 9 + 5 * i)) for i in range(6)]
SHARED = list(range(300, 340))   # 10 blocks of 4: a same-step prefix hit between two requests
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=5, ignore_eos=True)
SEEDED_N2 = SamplingParams(n=2, max_tokens=16, temperature=0.8, seed=11, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = make_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny")), arch="llama",
                                num_heads=4, num_kv_heads=2, seed=5)
    return LLM(path, dtype="float32", num_kv_blocks=256, block_size=4, check_invariants=True)


def tokens_of(out: RequestOutput) -> list[list[int]]:
    return [c.token_ids for c in sorted(out.outputs, key=lambda c: c.index)]


def innocents():
    return [("g0", PROMPTS[0], GREEDY), ("g1", PROMPTS[3], GREEDY), ("s0", PROMPTS[1], SEEDED),
            ("s1", PROMPTS[2], SEEDED_N2), ("dep", SHARED + [1, 2, 3], GREEDY)]


def culprits(vocab: int):
    """(id, prompt, params, how it is broken past validation)."""
    def nan_penalty(p):
        p.repetition_penalty = 1e-300      # 0 in float32: NaN logits, the sampler raises

    def huge_seed(p):
        p.seed = 2**64                     # torch.Generator.manual_seed overflows

    def mask_all(p):
        p.min_tokens, p.stop_token_ids = 2, list(range(vocab))  # every token masked

    temp = dataclasses.replace(GREEDY, temperature=1.0)
    return [("nan", PROMPTS[4], dataclasses.replace(GREEDY), nan_penalty),
            ("seed", PROMPTS[5], dataclasses.replace(temp), huge_seed),
            ("mask", PROMPTS[0][:5], dataclasses.replace(GREEDY), mask_all),
            ("shared", SHARED + [9], dataclasses.replace(GREEDY), nan_penalty)]


def test_validation_rejects_the_three_triggers_up_front(llm):
    with pytest.raises(ValueError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=1e-300)
    for seed in (2**64, -(2**63) - 1):
        with pytest.raises(ValueError, match="seed"):
            SamplingParams(seed=seed, temperature=1.0)
    vocab = llm.engine.vocab_size
    with pytest.raises(ValueError, match="min_tokens"):
        llm.generate([PROMPTS[0]], SamplingParams(min_tokens=2, max_tokens=4,
                                                  stop_token_ids=list(range(vocab))))
    assert llm.engine.kv.num_used_blocks == 0 and not llm.engine.has_unfinished_requests()


def test_faulty_requests_in_a_running_batch_fail_alone(llm):
    engine = llm.engine
    alone = {rid: tokens_of(llm.generate([p], params)[0]) for rid, p, params in innocents()}
    errors0 = engine.get_stats().num_step_errors
    results: dict[str, RequestOutput] = {}

    def add(rid, p, params, breaker=None):
        # a salt of its own: "dep" must hit the blocks "shared" registers in this step,
        # not those the reference runs left in the cache
        user, children = engine.make_requests(rid, p, params, cache_salt="isolation")
        if breaker is not None:
            breaker(children[0].sampling_params)
        engine.add_prepared(user, children)

    for rid, p, params in innocents()[:4]:
        add(rid, p, params)
    steps = 0
    while engine.has_unfinished_requests():
        # join a running batch. Step 3: only "nan", so the sampler raises after the seeded
        # rows drew (their generators must be restored). Step 6: the rest; "dep" hits the
        # blocks "shared" registers in that step.
        for rid, p, params, breaker in culprits(engine.vocab_size):
            if steps == (3 if rid == "nan" else 6):
                add(rid, p, params, breaker)
                if rid == "shared":
                    add(*innocents()[4])
        for out in engine.step():
            acc = results.setdefault(out.request_id, RequestOutput(out.request_id, None, [], []))
            merge_delta(acc, out)
        steps += 1
    for rid, _, _ in innocents():
        assert tokens_of(results[rid]) == alone[rid], rid
        assert results[rid].error is None
    for rid, *_ in culprits(engine.vocab_size):
        out = results[rid]
        assert [c.finish_reason for c in out.outputs] == ["error"], rid
        assert isinstance(out.error, RequestFailedError)
    assert results["seed"].error.input_error is True         # ValueError from manual_seed
    assert results["nan"].error.input_error is False
    assert engine.get_stats().num_step_errors > errors0
    assert engine.kv.num_used_blocks == 0


def test_async_llm_fails_only_the_culprit(llm):
    alone = {rid: tokens_of(llm.generate([p], params)[0]) for rid, p, params in innocents()[:4]}
    engine = AsyncLLM(llm.engine)

    async def consume(rid, p, params):
        out = RequestOutput(rid, None, [], [])
        async for delta in engine.generate(p, params, rid):
            merge_delta(out, delta)
        return out

    async def main():
        tasks = [asyncio.ensure_future(consume(rid, p, params))
                 for rid, p, params in innocents()[:4]]
        await asyncio.sleep(0)
        bad = dataclasses.replace(GREEDY, temperature=1.0)
        bad.seed = 2**64
        with pytest.raises(RequestFailedError) as info:
            await consume("bad", PROMPTS[5], bad)
        outs = await asyncio.gather(*tasks)
        return info.value, outs

    try:
        err, outs = asyncio.run(main())
    finally:
        engine.shutdown()
    assert err.input_error and err.error_id in str(err)
    assert {o.request_id: tokens_of(o) for o in outs} == alone
    assert llm.engine.kv.num_used_blocks == 0


def test_nan_logits_fail_their_requests_with_one_rerun_of_the_rest(llm):
    """NaN produced at run time names its rows: the culprits fail at once and their
    batch-mates' step runs again exactly once (no bisection), with the tokens they get
    alone."""
    engine = llm.engine
    alone = {rid: tokens_of(llm.generate([p], params)[0]) for rid, p, params in innocents()[:4]}
    before = engine.get_stats()
    calls = []
    execute = engine.runner.execute

    def counting(step_input):
        calls.append(engine.scheduler.step_index)
        return execute(step_input)

    engine.runner.execute = counting
    results: dict[str, RequestOutput] = {}
    try:
        for rid, p, params in innocents()[:4]:
            engine.add_prepared(*engine.make_requests(rid, p, params, cache_salt="nan-rerun"))
        steps = 0
        while engine.has_unfinished_requests():
            if steps == 3:   # two NaN rows join the running batch in one step
                for rid, p in (("nan_a", PROMPTS[4]), ("nan_b", PROMPTS[5])):
                    user, children = engine.make_requests(rid, p, dataclasses.replace(GREEDY))
                    children[0].sampling_params.repetition_penalty = 1e-300
                    engine.add_prepared(user, children)
            for out in engine.step():
                acc = results.setdefault(out.request_id, RequestOutput(out.request_id, None, [], []))
                merge_delta(acc, out)
            steps += 1
    finally:
        engine.runner.execute = execute
    after = engine.get_stats()
    for rid, *_ in innocents()[:4]:
        assert tokens_of(results[rid]) == alone[rid], rid
    for rid in ("nan_a", "nan_b"):
        assert results[rid].error is not None and "NaN" in str(results[rid].error)
    assert after.num_step_errors - before.num_step_errors == 1
    assert after.num_step_reruns - before.num_step_reruns == 1
    assert len(calls) == steps + 1    # one step ran twice, every other step once
    assert engine.kv.num_used_blocks == 0
