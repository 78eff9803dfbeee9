"""Embeddings through the real runner (tiny random Llama): ``LLM.embed`` equals transformers'
pooling of the same weights for each method, across prefill chunks; embedding requests
batched into the same steps as generation leave its greedy tokens unchanged and the KV
ledger intact."""
from __future__ import annotations

import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.pooling_params import PoolingParams
from tests.model.tiny_checkpoints import make_tiny_checkpoint

PROMPTS = [list(range(100, 141)), [5, 6, 7], [42]]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("pool")), arch="llama", seed=3)


@pytest.fixture(scope="module")
def llm(tiny_path):
    return LLM(tiny_path, dtype="float32", num_kv_blocks=64, block_size=4,
               max_num_batched_tokens=16, max_prefill_tokens_per_step=8, check_invariants=True)


@pytest.mark.parametrize("method", ["last", "mean", "cls"])
def test_embed_equals_transformers_pooling(method, llm, tiny_path):
    from transformers import AutoModel

    ref = AutoModel.from_pretrained(tiny_path, dtype=torch.float32).eval()
    vectors = llm.embed(PROMPTS, PoolingParams(method=method))
    for ids, vec in zip(PROMPTS, vectors):
        with torch.no_grad():
            h = ref(torch.tensor([ids])).last_hidden_state[0]
        want = {"last": h[-1], "mean": h.mean(0), "cls": h[0]}[method]
        want = torch.nn.functional.normalize(want, dim=0)
        assert torch.allclose(torch.tensor(vec), want, atol=1e-5, rtol=0)
    assert llm.engine.kv.num_used_blocks == 0 and llm.engine.runner.pooler.num_pending == 0


def test_embeddings_batched_with_generation_keep_its_tokens(llm):
    engine = llm.engine
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate([[11, 12, 13], [300, 301]], params)]
    steps = []
    execute = engine.executor.execute

    def spy(step):
        steps.append((bool(step.pooling), any(step.num_samples)))
        return execute(step)

    engine.executor.execute = spy   # the core holds the executor: wrap its method
    try:
        for i, p in enumerate([[11, 12, 13], [300, 301]]):
            engine.add_request(f"g{i}", p, params)
        for i, p in enumerate(PROMPTS):
            user, children = engine.make_embedding_request(f"e{i}", p,
                                                           PoolingParams(method="mean"))
            engine.add_prepared(user, children)
        got: dict[str, list[int]] = {}
        vectors = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                got.setdefault(out.request_id, []).extend(
                    t for c in out.outputs for t in c.token_ids)
                if out.embedding is not None:
                    vectors[out.request_id] = out.embedding
    finally:
        del engine.executor.execute
    assert (True, True) in steps, "no step ran an embedding beside a sampled sequence"
    assert [got["g0"], got["g1"]] == alone
    assert sorted(vectors) == ["e0", "e1", "e2"]
    assert engine.kv.num_used_blocks == 0
    engine.check_invariants()


def test_dimensions_above_the_hidden_size_are_refused(llm):
    with pytest.raises(ValueError, match="dimensions"):
        llm.embed([1, 2], PoolingParams(dimensions=10_000))
    with pytest.raises(ValueError, match="context length"):
        llm.embed([list(range(1, 1000))])
