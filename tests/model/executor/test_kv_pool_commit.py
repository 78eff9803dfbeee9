"""The runner's KV pool commits its first blocks at start and the engine's BlockPool hands
them out before its reserve: an engine with a small commit grows into the reserve only as
far as the blocks in use need, with prefix hits and the ledger intact."""
from __future__ import annotations

import pytest

from llmserve import SamplingParams
from tests.model.tiny_checkpoints import make_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("commit")), arch="llama",
                                num_heads=4, num_kv_heads=2, seed=7)


def test_engine_with_a_small_commit_grows_into_the_reserve_and_keeps_its_ledger(tiny_path):
    from llmserve import LLM
    llm = LLM(tiny_path, num_kv_blocks=64, block_size=4, kv_cache_commit_tokens=10,
              enforce_eager=True, check_invariants=True)
    pool = llm.engine.kv.pool
    assert llm.engine.runner.committed_blocks == 3 and pool.next_reserve == 3
    params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0)
    first = llm.generate([list(range(10, 30))], params)[0].outputs[0].token_ids
    grown = pool.next_reserve
    assert grown > 3                               # 26 tokens need 7 blocks
    again = llm.generate([list(range(10, 30))], params)[0]
    assert again.outputs[0].token_ids == first and again.num_cached_tokens >= 16
    # 7 more blocks: the 3 cold ones first (never hit), then 4 from the reserve, while the
    # 4 blocks that served the hit are kept
    llm.generate([list(range(500, 520))], params)
    assert pool.next_reserve == grown + 4
    again = llm.generate([list(range(10, 30))], params)[0]
    assert again.outputs[0].token_ids == first and again.num_cached_tokens >= 16
    llm.engine.kv.check_invariants()


