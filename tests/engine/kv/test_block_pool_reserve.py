"""The KV pool's committed blocks and reserve: cached blocks nobody hit are recycled before a
block that was never used is handed out, blocks that served a hit only after the reserve, the
reserve counts as free, and the ledger check covers it."""
from __future__ import annotations

import pytest

from llmserve.config import EngineConfig
from llmserve.engine.kv.block_hash import BlockHash
from llmserve.engine.kv.block_pool import BlockPool
from llmserve.engine.kv.kv_cache_manager import KVCacheManager, KVLedgerError
from llmserve.engine.request import Request
from llmserve.sampling_params import SamplingParams


def cache(pool: BlockPool, blocks, tag: int) -> None:
    for i, b in enumerate(blocks):
        pool.cache_block(b, BlockHash([tag, i]), None)


def test_committed_blocks_first_then_cached_ones_then_the_reserve():
    pool = BlockPool(10, committed_blocks=4)
    assert (pool.num_free_blocks, pool.num_reserve_blocks, pool.num_used_blocks) == (10, 6, 0)
    first = pool.allocate(3)
    assert [b.block_id for b in first] == [0, 1, 2]
    cache(pool, first, 1)
    pool.free(reversed(first))
    # one committed block never used, then the three cached ones (LRU), then the reserve
    got = pool.allocate(5)
    assert [b.block_id for b in got] == [3, 2, 1, 0, 4]
    assert pool.num_evictions == 3 and not pool.cached
    assert (pool.num_free_blocks, pool.num_reserve_blocks) == (5, 5)
    pool.free(got)          # block 4 is committed now: it goes to the queue like the others
    assert pool.free_queue.num_free == 5 and pool.num_reserve_blocks == 5
    assert [b.block_id for b in pool.allocate(10)] == [3, 2, 1, 0, 4, 5, 6, 7, 8, 9]
    with pytest.raises(RuntimeError, match="only 0 free"):
        pool.allocate(1)


def test_a_block_that_served_a_hit_outlives_the_reserve():
    pool = BlockPool(8, committed_blocks=3)
    first = pool.allocate(3)
    cache(pool, first, 2)
    pool.free(reversed(first))
    hit = pool.lookup(BlockHash([2, 0]))
    pool.touch([hit])                             # a prefix hit: block 0 turns hot
    assert hit.hot and pool.free_queue.num_free == 2
    pool.free([hit])
    assert pool.hot_queue.num_free == 1 and pool.num_free_blocks == 8
    got = [b.block_id for b in pool.allocate(7)]
    assert got == [2, 1, 3, 4, 5, 6, 7]           # cold ones, then the whole reserve
    assert pool.lookup(BlockHash([2, 0])) is hit and hit.hot
    assert [b.block_id for b in pool.allocate(1)] == [0] and not hit.hot
    assert pool.lookup(BlockHash([2, 0])) is None and pool.num_evictions == 3


def test_uncaching_a_free_hot_block_moves_it_to_the_cold_queue():
    pool = BlockPool(4, committed_blocks=1)
    (b,) = pool.allocate(1)
    cache(pool, [b], 3)
    pool.touch([b])
    pool.free([b, b])
    assert pool.hot_queue.num_free == 1
    assert pool.uncache([b]) == 1
    assert not b.hot and pool.hot_queue.num_free == 0 and pool.free_queue.num_free == 1
    assert [x.block_id for x in pool.allocate(2)] == [0, 1]


def test_a_cached_block_is_kept_while_the_pool_commits_everything_by_default():
    pool = BlockPool(6)                          # committed_blocks None: a plain LRU pool
    assert pool.num_reserve_blocks == 0
    first = pool.allocate(2)
    cache(pool, first, 7)
    pool.free(first)
    assert [b.block_id for b in pool.allocate(4)] == [2, 3, 4, 5]
    assert len(pool.cached) == 2 and pool.num_evictions == 0


@pytest.mark.parametrize("committed", [0, 3, 99])
def test_committed_count_is_clamped(committed):
    pool = BlockPool(8, committed_blocks=committed)
    assert pool.next_reserve == min(8, committed)
    assert len(pool.allocate(8)) == 8


def _request(rid: str, n: int) -> Request:
    return Request(rid, list(range(100, 100 + n)),
                   SamplingParams(max_tokens=1, ignore_eos=True), max_model_len=4096)


def test_ledger_check_accepts_the_reserve_and_catches_a_reserve_block_in_the_queue():
    kv = KVCacheManager(16, 4, committed_blocks=2)
    r = _request("a", 13)                         # 4 blocks: 2 committed + 2 from the reserve
    assert kv.allocate_slots(r, 13)
    kv.check_invariants()
    assert kv.pool.next_reserve == 4 and kv.num_free_blocks == 12
    kv.free(r)
    kv.check_invariants()
    assert kv.pool.free_queue.num_free == 4
    kv.pool.free_queue.append(kv.pool.blocks[9])  # corrupt: a reserve block in the queue
    with pytest.raises(KVLedgerError, match="reserve block"):
        kv.check_invariants()


def test_engine_config_rejects_a_negative_commit():
    with pytest.raises(ValueError, match="kv_cache_commit_tokens"):
        EngineConfig.from_kwargs(kv_cache_commit_tokens=-1)
