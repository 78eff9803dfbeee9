"""LoRA in the engine core (no torch): slots per step, namespaces, step inputs."""
from __future__ import annotations

from llmserve.engine.kv.block_hash import namespace_hash
from llmserve.engine.request import Request
from llmserve.lora.registry import AdapterStepBudget, LoraRef, lora_cache_salt
from llmserve.sampling_params import SamplingParams
from tests.engine.conftest import make_core


def ref(name: str) -> LoraRef:
    return LoraRef(name, f"/adapters/{name}", f"{name:0<64}"[:64], 4, 2.0, ("q_proj",))


def req(rid: str, lora=None, salt=None, prompt=None) -> Request:
    return Request(rid, prompt or list(range(20, 45)),
                   SamplingParams(max_tokens=6, ignore_eos=True, temperature=0),
                   arrival_time=1000.0, cache_salt=salt, max_model_len=4096, lora=lora)


def test_a_step_never_mixes_more_adapters_than_slots():
    core = make_core(max_num_seqs=16, max_loras=2)
    adapters = [ref(n) for n in "abc"]
    for i in range(9):
        core.add_request(req(f"r{i}", adapters[i % 3] if i % 4 else None))
    seen: set[str] = set()
    while core.scheduler.requests:
        core.step()
        step = core.runner.steps[-1]
        distinct = {lo.name for lo in step.loras if lo is not None}
        assert len(distinct) <= 2
        seen |= distinct
        assert len(step.loras) == step.num_seqs
    assert seen == {"a", "b", "c"}   # the third adapter ran in later steps


def test_base_requests_are_never_held_back_by_adapters():
    core = make_core(max_num_seqs=16, max_loras=1)
    core.add_request(req("a1", ref("a")))
    core.add_request(req("b1", ref("b")))
    core.add_request(req("base", None))
    core.step()
    ids = set(core.runner.steps[-1].request_ids)
    assert "base" in ids and len(ids & {"a1", "b1"}) == 1


def test_adapter_namespaces_are_children_of_the_tenant():
    a, b = ref("a"), ref("b")
    assert lora_cache_salt(None, None) is None
    assert lora_cache_salt("tenant:x", None) == "tenant:x"
    assert lora_cache_salt("tenant:x", a) == f"tenant:x|lora:{a.content_hash}"
    roots = {namespace_hash("fp", lora_cache_salt(s, lo)) for s in (None, "tenant:x")
             for lo in (None, a, b)}
    assert len(roots) == 6
    r = req("r", a, salt="tenant:x")
    assert r.cache_salt == f"tenant:x|lora:{a.content_hash}" and r.lora is a


def test_same_prompt_under_two_adapters_shares_no_block():
    core = make_core(max_num_seqs=16, max_loras=2)
    prompt = list(range(50, 50 + 33))
    for i, lora in enumerate([ref("a"), ref("b"), None, ref("a")]):
        core.add_request(req(f"r{i}", lora, prompt=prompt))
        while core.scheduler.requests:
            core.step()
    hits = core.scheduler.prefix.hit_by_tenant
    lora_a = f"lora:{ref('a').content_hash}"
    lora_b = f"lora:{ref('b').content_hash}"
    assert hits[lora_b] == 0 and hits[""] == 0 and hits[lora_a] > 0   # only a's 2nd run hit


def test_step_budget_counts_distinct_adapters():
    budget = AdapterStepBudget(2)
    a, b, c = ref("a"), ref("b"), ref("c")
    assert [budget.admits(x) for x in (a, None, a, b, c, None, b)] == \
        [True, True, True, True, False, True, True]
    assert AdapterStepBudget(0).admits(a)
