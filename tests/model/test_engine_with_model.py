"""Engine behaviour on a real (tiny) model: preemption, mid-run arrivals, n, seeds, async abort."""
from __future__ import annotations

import asyncio
import threading

import pytest

from llmserve import LLM, SamplingParams
from llmserve.async_llm import AsyncLLM
from tests.model.tiny_checkpoints import make_tiny_checkpoint

PROMPTS = [list(range(10 + 7 * i, 10 + 7 * i + 9 + 5 * i)) for i in range(6)]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny")), arch="llama",
                                num_heads=4, num_kv_heads=2, seed=3)


def test_tiny_pool_preempts_and_matches_ample_pool(tiny_path):
    ample = LLM(tiny_path, dtype="float32", num_kv_blocks=128, block_size=4, check_invariants=True)
    ref = [o.outputs[0].token_ids for o in ample.generate(PROMPTS, GREEDY)]
    tight = LLM(tiny_path, dtype="float32", num_kv_blocks=24, block_size=4, check_invariants=True,
                enable_prefix_caching=False)
    got = [o.outputs[0].token_ids for o in tight.generate(PROMPTS, GREEDY)]
    assert tight.get_stats().num_preemptions > 0
    assert got == ref
    assert tight.engine.kv.num_used_blocks == 0


def test_requests_added_mid_run_match_alone(tiny_path):
    llm = LLM(tiny_path, dtype="float32", num_kv_blocks=128, block_size=4, check_invariants=True)
    alone = [llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in PROMPTS[:4]]
    eng = llm.engine
    got: dict[str, list[int]] = {}
    pending = list(enumerate(PROMPTS[:4]))
    steps = 0
    while pending or eng.has_unfinished_requests():
        if pending and steps % 3 == 0:  # one new request every third step
            i, p = pending.pop(0)
            eng.add_request(f"m{i}", p, GREEDY)
        for d in eng.step():
            got.setdefault(d.request_id, []).extend(d.outputs[0].token_ids)
        steps += 1
    assert [got[f"m{i}"] for i in range(4)] == alone


def test_n_completions_and_seeds(tiny_path):
    llm = LLM(tiny_path, dtype="float32", num_kv_blocks=128, block_size=4)
    p = SamplingParams(n=3, max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    a = llm.generate([PROMPTS[0]], p)[0]
    assert [c.index for c in a.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 12 for c in a.outputs)
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1  # different draws per completion
    # the same seed gives the same tokens, whatever else is in the batch
    others = [SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)] * 3
    b = llm.generate([PROMPTS[0]] + PROMPTS[1:4], [p] + others)[0]
    assert [c.token_ids for c in b.outputs] == [c.token_ids for c in a.outputs]


def test_async_cancel_mid_decode_frees_kv(tiny_path):
    engine = AsyncLLM(LLM(tiny_path, dtype="float32", num_kv_blocks=128, block_size=4).engine)

    async def main():
        before = engine.engine.kv.num_used_blocks
        gen = engine.generate(PROMPTS[2], SamplingParams(max_tokens=400, temperature=0,
                                                         ignore_eos=True), "req-1")
        seen = 0
        async for out in gen:
            seen += len(out.outputs[0].token_ids)
            if seen >= 3:
                break
        await gen.aclose()
        for _ in range(100):
            await asyncio.sleep(0.02)
            if engine.get_stats().num_running == 0:
                break
        assert engine.engine.kv.num_used_blocks == before
        assert engine.get_stats().num_aborted == 1
        # the engine keeps serving
        outs = [o async for o in engine.generate(PROMPTS[0], GREEDY, "req-2")]
        assert outs[-1].finished and outs[-1].outputs[-1].finish_reason == "length"

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()


def test_stop_string_spanning_tokens_is_never_shown(tiny_path):
    llm = LLM(tiny_path, dtype="float32", num_kv_blocks=128, block_size=4)
    free = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=40, temperature=0,
                                                     ignore_eos=True))[0].outputs[0]
    text = free.text
    assert len(text) > 20
    stop = text[10:16]
    first = text.index(stop)
    out = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True,
                                                    stop=[stop]))[0].outputs[0]
    assert out.text == text[:first]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    # streamed through the engine, the pieces never show the stop string either
    eng = llm.engine
    eng.add_request("s", PROMPTS[1], SamplingParams(max_tokens=40, temperature=0,
                                                   ignore_eos=True, stop=[stop]))
    pieces = []
    while eng.has_unfinished_requests():
        pieces += [c.text for d in eng.step() for c in d.outputs]
    assert "".join(pieces) == text[:first]


def test_stop_token_ids_min_tokens_and_logprobs(tiny_path):
    import torch

    llm = LLM(tiny_path, dtype="float32", num_kv_blocks=128, block_size=4)
    free = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=12, temperature=0,
                                                     ignore_eos=True))[0].outputs[0]
    stop_id = free.token_ids[5]
    k = free.token_ids.index(stop_id)
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                    stop_token_ids=[stop_id]))[0].outputs[0]
    assert out.token_ids == free.token_ids[:k + 1] and out.stop_reason == stop_id
    lp = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True,
                                                   logprobs=3))[0].outputs[0]
    assert len(lp.logprobs) == 4
    for tok, entry in zip(lp.token_ids, lp.logprobs):
        assert entry.token_id == tok and len(entry.top_logprobs) == 3
        tops = [t.logprob for t in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        assert entry.top_logprobs[0].token_id == tok  # greedy picks the most likely token
        assert abs(entry.logprob - tops[0]) < 1e-6 and entry.logprob <= 0
        assert sum(torch.tensor(tops).exp().tolist()) <= 1.0 + 1e-5


def test_bfloat16_runs_and_stays_close_to_fp32(tiny_path):
    import torch

    from tests.model.test_parity import StepRecorder

    def last_logits(dtype):
        llm = LLM(tiny_path, num_kv_blocks=64, block_size=4, dtype=dtype)
        rec = StepRecorder(llm)
        out = llm.generate([PROMPTS[3]], SamplingParams(max_tokens=3, temperature=0,
                                                        ignore_eos=True))[0]
        assert llm.engine.runner.kv_caches[0][0].dtype == getattr(torch, dtype)
        return torch.stack(rec.sampled_logits(out.request_id))

    a, b = last_logits("float32"), last_logits("bfloat16")
    cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)
    assert (cos > 0.99).all(), cos


def test_padded_vocab_rows_are_never_sampled_nor_accepted(tmp_path):
    path = make_tiny_checkpoint(str(tmp_path / "pad"), arch="llama", num_heads=4, num_kv_heads=2,
                                vocab_size=49408, seed=9)
    llm = LLM(path, num_kv_blocks=64, block_size=4)
    assert llm.engine.vocab_size == 49152
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([[10, 11, 49300]], SamplingParams(max_tokens=2))
    outs = llm.generate([PROMPTS[0]] * 4, SamplingParams(max_tokens=40, temperature=2.0, seed=1,
                                                        ignore_eos=True))
    assert all(t < 49152 for o in outs for t in o.outputs[0].token_ids)
    assert llm.engine.kv.num_used_blocks == 0 or not llm.engine.has_unfinished_requests()


def test_generate_validates_every_prompt_before_running_any(tiny_path):
    llm = LLM(tiny_path, dtype="float32", num_kv_blocks=64, block_size=4)
    with pytest.raises(ValueError):
        llm.generate([PROMPTS[0], [10**9]], SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished_requests()


def test_async_reused_id_and_shutdown(tiny_path):
    engine = AsyncLLM(LLM(tiny_path, dtype="float32", num_kv_blocks=128, block_size=4).engine)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)

    async def main():
        a = engine.generate(PROMPTS[1], params, "same-id")
        await a.__anext__()
        await a.aclose()                      # caller A goes away ...
        b = [o async for o in engine.generate(PROMPTS[2], params, "same-id")]  # ... and retries
        toks = [t for o in b for c in o.outputs for t in c.token_ids]
        assert len(toks) == 30 and b[-1].finished
        assert {o.request_id for o in b} == {"same-id"}
        alone = LLM(tiny_path, dtype="float32", num_kv_blocks=128, block_size=4).generate([PROMPTS[2]], params)
        assert toks == alone[0].outputs[0].token_ids
        # shutdown ends an open stream with an error instead of leaving it hanging
        c = engine.generate(PROMPTS[0], SamplingParams(max_tokens=400, ignore_eos=True), "c")
        await c.__anext__()
        engine.shutdown()
        with pytest.raises(RuntimeError):
            async for _ in c:
                pass

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()


def test_async_streams_get_one_step_in_one_wake_up(tiny_path):
    # four streams decoding together: each step's deltas reach the event loop in one
    # call_soon_threadsafe (not one per stream), in order, and match an offline run
    engine = AsyncLLM(LLM(tiny_path, dtype="float32", num_kv_blocks=128, block_size=4).engine)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)

    async def collect(i: int) -> list[int]:
        return [t async for o in engine.generate(PROMPTS[i % len(PROMPTS)], params, f"s{i}")
                for t in o.outputs[0].token_ids]

    async def main() -> tuple[list[list[int]], int]:
        loop = asyncio.get_running_loop()
        calls = 0
        original = loop.call_soon_threadsafe

        def counting(*args, **kwargs):
            nonlocal calls
            calls += 1
            return original(*args, **kwargs)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        try:
            return list(await asyncio.gather(*(collect(i) for i in range(4)))), calls
        finally:
            loop.call_soon_threadsafe = original  # type: ignore[method-assign]

    try:
        streams, wake_ups = asyncio.run(main())
    finally:
        engine.shutdown()
    alone = LLM(tiny_path, dtype="float32", num_kv_blocks=128, block_size=4).generate(
        [PROMPTS[i % len(PROMPTS)] for i in range(4)], params)
    assert streams == [o.outputs[0].token_ids for o in alone]
    # per-stream delivery would take 4 x 12 = 48 wake-ups, two per step 24; one per
    # step 12 (one token a step) plus a step or two while the four adds arrive
    assert 12 <= wake_ups <= 18


def test_async_engine_audits_kv_ledger_when_idle(tiny_path):
    import time

    engine = AsyncLLM(LLM(tiny_path, dtype="float32", num_kv_blocks=32, block_size=4).engine)
    try:
        deadline = time.time() + 5
        while engine._last_audit == 0.0 and time.time() < deadline:
            time.sleep(0.05)
        assert engine._last_audit > 0.0 and engine.ledger_errors == 0
        # a corrupted ledger is reported, not ignored
        engine.engine.kv.pool.blocks[0].ref_cnt = 5
        engine._last_audit = 0.0
        deadline = time.time() + 5
        while engine.ledger_errors == 0 and time.time() < deadline:
            time.sleep(0.05)
        assert engine.ledger_errors == 1
    finally:
        engine.shutdown()


def test_from_config_builds_and_steps_the_engine_on_one_thread(tiny_path):
    """Every torch op of a served engine runs on the engine thread: a second thread with
    an OpenMP pool throttles every parallel region (see llmserve/async_llm.py)."""
    import threading

    from llmserve.config import EngineConfig
    from llmserve.llm_engine import LLMEngine

    built_on = []

    def build():
        built_on.append(threading.current_thread())
        return LLMEngine(EngineConfig.from_kwargs(model=tiny_path, dtype="float32",
                                                  num_kv_blocks=64, block_size=4))

    engine = AsyncLLM(engine_factory=build)
    try:
        assert built_on == [engine._thread] and built_on[0] is not threading.main_thread()
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)

        async def main():
            return [t async for o in engine.generate(PROMPTS[0], params, "r")
                    for t in o.outputs[0].token_ids]
        alone = LLM(tiny_path, dtype="float32", num_kv_blocks=64, block_size=4).generate(
            [PROMPTS[0]], params)
        assert asyncio.run(main()) == alone[0].outputs[0].token_ids
    finally:
        engine.shutdown()
    with pytest.raises((OSError, ValueError)):   # a build error reaches the caller
        AsyncLLM.from_config(EngineConfig.from_kwargs(model=tiny_path + "/missing"))
    with pytest.raises(ValueError, match="not both"):
        AsyncLLM()


def test_offline_generate_returns_prompt_logprobs_as_transformers_scores_them(tiny_path):
    """`LLM.generate(..., SamplingParams(prompt_logprobs=k))` returns one entry per prompt
    token (None for the first), each the token's logprob under the model given the tokens
    before it, as transformers computes it, with the top-k alternatives."""
    import torch
    from transformers import AutoModelForCausalLM

    llm = LLM(tiny_path, dtype="float32", num_kv_blocks=128, block_size=4)
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2, ignore_eos=True)
    outs = llm.generate(PROMPTS[:3], params)
    hf = AutoModelForCausalLM.from_pretrained(tiny_path, torch_dtype=torch.float32).eval()
    for prompt, out in zip(PROMPTS[:3], outs):
        lps = out.prompt_logprobs
        assert lps is not None and len(lps) == len(prompt) and lps[0] is None
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
        for pos in range(1, len(prompt)):
            entry = lps[pos]
            assert entry.token_id == prompt[pos]
            assert entry.logprob == pytest.approx(ref[pos - 1, prompt[pos]].item(), abs=1e-3)
            top = ref[pos - 1].topk(2)
            assert [t.token_id for t in entry.top_logprobs][:2] == top.indices.tolist()
    # no prompt_logprobs asked: none returned
    assert llm.generate(PROMPTS[:1], GREEDY)[0].prompt_logprobs is None


def test_a_thinking_budget_forces_the_close_marker_after_n_tokens(tiny_path):
    """A request whose prompt opened a think block reasons for at most its budget of
    tokens; then the close marker's tokens are forced one per step and the answer goes on
    freely. The same request without a budget (and the other rows of the batch) keep
    their greedy tokens."""
    from llmserve.structured_output.reasoning_budget import ReasoningBudget
    from tests.model.tiny_checkpoints import default_tokenizer

    end = tuple(default_tokenizer().encode("</think>", add_special_tokens=False))
    llm = LLM(tiny_path, dtype="float32", num_kv_blocks=128, block_size=4)
    free = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    budget = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                            reasoning_budget=ReasoningBudget(4, end))
    plain, forced, neighbour = llm.generate([PROMPTS[0], PROMPTS[0], PROMPTS[1]],
                                            [free, budget, free])
    alone = llm.generate([PROMPTS[1]], free)[0]
    ids = list(forced.outputs[0].token_ids)
    assert ids[:4] == list(plain.outputs[0].token_ids)[:4]
    assert tuple(ids[4:4 + len(end)]) == end and len(ids) == 12
    assert list(neighbour.outputs[0].token_ids) == list(alone.outputs[0].token_ids)
    zero = llm.generate([PROMPTS[0]], SamplingParams(
        max_tokens=6, temperature=0.8, seed=3, ignore_eos=True,
        reasoning_budget=ReasoningBudget(0, end)))[0]
    assert tuple(zero.outputs[0].token_ids[:len(end)]) == end


def test_an_idle_async_engine_does_its_idle_work_without_requests(tiny_path):
    """The serving loop calls ``LLMEngine.on_idle`` while no request runs (where a finished
    background compile's graphs load), and not between the steps of a request."""
    llm = LLM(tiny_path, dtype="float32", num_kv_blocks=128, block_size=4)
    idle = threading.Event()
    during = []
    llm.engine.on_idle = lambda: (idle.set(), during.append(
        llm.engine.has_unfinished_requests()))
    engine = AsyncLLM(llm.engine)
    try:
        assert idle.wait(5.0)

        async def main():
            async for _ in engine.generate(PROMPTS[0], SamplingParams(max_tokens=20),
                                           "req-idle"):
                pass

        asyncio.run(main())
        assert not any(during)
    finally:
        engine.shutdown()
