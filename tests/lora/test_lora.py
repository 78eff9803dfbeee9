"""LoRA adapters against transformers + peft, mixed batches, slots and the prefix cache."""
from __future__ import annotations

import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.lora.registry import LoraInUse, LoraNotFound
from tests.lora.lora_helpers import load_peft, make_adapter_set, peft_greedy, peft_logits
from tests.model.family_parity import ATOL, RTOL, StepRecorder

pytest.importorskip("peft")

PROMPTS = [[5, 17, 300, 42, 9, 1000, 77], list(range(100, 131)), [11, 12, 13]]
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_adapter_set(str(tmp_path_factory.mktemp("lora")))


def make_llm(tiny, **kw) -> LLM:
    base, a, b = tiny
    args = dict(num_kv_blocks=64, block_size=16, dtype="float32", check_invariants=True,
                enable_prefix_caching=False, max_loras=2, lora_modules=(("a", a), ("b", b)))
    args.update(kw)
    return LLM(base, **args)


@pytest.mark.parametrize("which", ["a", "b"])
def test_logits_and_greedy_tokens_match_peft(tiny, which):
    base, a, b = tiny
    ref = load_peft(base, a if which == "a" else b)
    llm = make_llm(tiny)
    rec = StepRecorder(llm, all_logits=True)
    for prompt in PROMPTS:
        rec.steps.clear()
        out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0), lora=which)
        got = rec.steps[0].all_logits[out[0].request_id]
        torch.testing.assert_close(got, peft_logits(ref, prompt), atol=ATOL, rtol=RTOL)
    outs = llm.generate(PROMPTS, GREEDY, lora=which)
    for prompt, out in zip(PROMPTS, outs):
        assert out.outputs[0].token_ids == peft_greedy(ref, prompt, GREEDY.max_tokens)
    with ref.disable_adapter():   # the adapter changes the model (the test could fail)
        assert peft_greedy(ref, PROMPTS[0], 10) != outs[0].outputs[0].token_ids


def test_mixed_batch_equals_each_alone(tiny):
    llm = make_llm(tiny)
    rec = StepRecorder(llm)
    mix = [("a", PROMPTS[0]), (None, PROMPTS[0]), ("b", PROMPTS[1]), ("a", PROMPTS[2]),
           ("b", PROMPTS[0])]
    together = llm.generate([p for _, p in mix], GREEDY, lora=[name for name, _ in mix])
    logits_together = [torch.stack(rec.sampled_logits(o.request_id)) for o in together]
    for (name, prompt), out, logits in zip(mix, together, logits_together):
        rec.steps.clear()
        alone = llm.generate([prompt], GREEDY, lora=name)[0]
        assert alone.outputs[0].token_ids == out.outputs[0].token_ids
        alone_logits = torch.stack(rec.sampled_logits(alone.request_id))
        assert torch.equal(alone_logits, logits), (   # the same bits: one sum order per row
            f"{name}: logits differ by {(alone_logits - logits).abs().max().item():.3g}")
    assert len({tuple(o.outputs[0].token_ids) for o in together[:2]}) == 2  # a != base


def test_more_adapters_than_slots_are_swapped_in(tiny):
    one_slot = make_llm(tiny, max_loras=1)
    mix = [("a", PROMPTS[0]), ("b", PROMPTS[0]), ("a", PROMPTS[1]), (None, PROMPTS[2])]
    together = one_slot.generate([p for _, p in mix], GREEDY, lora=[n for n, _ in mix])
    assert one_slot.engine.runner.lora.num_swaps >= 2
    reference = make_llm(tiny)
    for (name, prompt), out in zip(mix, together):
        alone = reference.generate([prompt], GREEDY, lora=name)[0]
        assert alone.outputs[0].token_ids == out.outputs[0].token_ids


def test_same_prompt_under_two_adapters_never_shares_blocks(tiny):
    llm = make_llm(tiny, enable_prefix_caching=True, block_size=4)
    prompt = list(range(200, 213))   # 3 full blocks + 1
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    first = [llm.generate([prompt], params, lora=name)[0] for name in ("a", "b", None)]
    assert [o.num_cached_tokens for o in first] == [0, 0, 0]
    again = [llm.generate([prompt], params, lora=name)[0] for name in ("a", "b", None)]
    assert [o.num_cached_tokens for o in again] == [12, 12, 12]
    # three namespaces, each holding its own copy of the prompt's blocks
    cached = llm.engine.kv.pool.cached.values()
    by_ns: dict = {}
    for block in cached:
        by_ns.setdefault(block.namespace, set()).add(block.block_id)
    lora_ns = [ns for ns in by_ns if ns and ns.startswith("lora:")]
    assert len(lora_ns) == 2 and None in by_ns
    ids = [by_ns[ns] for ns in lora_ns + [None]]
    assert not (ids[0] & ids[1]) and not (ids[0] & ids[2]) and not (ids[1] & ids[2])
    # a tenant's adapter namespace is a child of the tenant's (flushing the tenant drops it)
    out = llm.generate([prompt], params, lora="a", cache_salt="tenant:t")[0]
    assert out.num_cached_tokens == 0
    assert llm.engine.reset_prefix_cache("tenant:t", with_children=True) > 0


def test_unload_refuses_while_in_use_and_unknown_names_fail(tiny):
    llm = make_llm(tiny)
    engine = llm.engine
    engine.add_request("r1", PROMPTS[0], GREEDY, lora="b")
    with pytest.raises(LoraInUse, match="used by 1 request"):
        engine.loras.remove("b")
    while engine.has_unfinished_requests():
        engine.step()
    engine.loras.remove("b")
    assert [r.name for r in engine.loras.list()] == ["a"]
    with pytest.raises(LoraNotFound):
        llm.generate([PROMPTS[0]], GREEDY, lora="b")
    engine.loras.add("b", tiny[2])   # loaded again at run time
    assert llm.generate([PROMPTS[0]], GREEDY, lora="b")[0].outputs[0].token_ids
    engine.check_invariants()


def test_without_lora_the_layers_are_not_wrapped(tiny):
    from llmserve.lora.layers import LoraLinear

    llm = LLM(tiny[0], num_kv_blocks=16, dtype="float32")
    assert llm.engine.runner.lora is None
    assert not any(isinstance(m, LoraLinear) for m in llm.engine.runner.model.modules())
    with pytest.raises(ValueError, match="not enabled"):
        llm.generate([PROMPTS[0]], GREEDY, lora="a")


def test_compiled_base_steps_and_eager_adapter_steps_agree_with_eager(tiny):
    eager = make_llm(tiny, max_num_seqs=2)
    compiled = make_llm(tiny, max_num_seqs=2, enforce_eager=False)   # one bucket to compile
    runner = compiled.engine.runner
    assert runner.compiled is not None and runner.lora is not None
    calls = []
    inner = runner.compiled

    class Counting:   # counts the decode steps that ran through the compiled graph
        def __getattr__(self, name):
            return getattr(inner, name)

        def __call__(self, staged):
            calls.append(staged.num_seqs)
            return inner(staged)

    runner.compiled = Counting()
    mix = [("a", PROMPTS[0]), (None, PROMPTS[1])]
    for names in ([None, None], [n for n, _ in mix]):   # base-only, then mixed
        calls.clear()
        want = eager.generate([p for _, p in mix], GREEDY, lora=names)
        got = compiled.generate([p for _, p in mix], GREEDY, lora=names)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
        assert bool(calls) == (names[0] is None)   # adapter steps never enter the graph
    assert not inner.failed
