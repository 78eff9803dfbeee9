"""The KV event log on the KV manager (no model): stored runs, removals on eviction and
reset, AllBlocksCleared, and vLLM-compatible hashes checked against cbor2."""
from __future__ import annotations

import hashlib

import pytest

from llmserve.engine.kv.kv_cache_manager import KVCacheManager
from llmserve.engine.kv.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ExternalHashing,
    KVEventLog,
    cbor,
    to_u64,
    vllm_block_hashes,
)
from llmserve.engine.request import Request
from llmserve.sampling_params import SamplingParams

BS = 4


def req(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=2), cache_salt=salt, max_model_len=4096)


def manager(num_blocks: int = 8, mode: str = "llmserve") -> tuple[KVCacheManager, KVEventLog]:
    kv = KVCacheManager(num_blocks, BS, fingerprint="fp")
    log = KVEventLog(BS, ExternalHashing(mode))
    kv.enable_events(log)
    return kv, log


def test_prefill_announces_every_full_block_once_with_its_parent() -> None:
    kv, log = manager()
    a = req("a", list(range(10)))          # 2 full blocks + 2 tokens
    assert kv.allocate_slots(a, 10)
    (ev,) = log.take()
    assert isinstance(ev, BlockStored)
    assert ev.block_hashes == [to_u64(h) for h in a.block_hashes[:2]]
    assert ev.parent_block_hash is None and ev.token_ids == list(range(8)) and ev.block_size == BS
    # the third block fills during decode: one more event, chained to block 1
    a.num_computed_tokens = 10
    a.all_token_ids += [10, 11]
    assert kv.allocate_slots(a, 2)
    (ev2,) = log.take()
    assert ev2.block_hashes == [to_u64(a.block_hashes[2])]
    assert ev2.parent_block_hash == to_u64(a.block_hashes[1])
    # a second request hitting the same prefix announces nothing new
    b = req("b", list(range(9)))
    hits = kv.find_cached_prefix(b)
    assert len(hits) == 2 and kv.allocate_slots(b, 1, hits)
    assert log.take() == []


def test_eviction_and_resets_are_announced() -> None:
    kv, log = manager(num_blocks=4)
    a = req("a", list(range(16)))
    assert kv.allocate_slots(a, 16)
    stored = log.take()[0].block_hashes
    kv.free(a)
    b = req("b", list(range(100, 104)))
    assert kv.allocate_slots(b, 4)          # takes the LRU block: a's last one, evicted
    events = log.take()
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert [h for e in removed for h in e.block_hashes] == [stored[3]]
    assert removed[0].medium == "GPU"
    kv.reset_prefix_cache("nobody", all_namespaces=False)
    assert log.take() == []
    kv.reset_prefix_cache()
    assert [type(e) for e in log.take()] == [AllBlocksCleared]


def test_a_partial_reset_lists_the_removed_blocks() -> None:
    kv, log = manager()
    a, t = req("a", list(range(8))), req("t", list(range(8)), salt="tenant")
    assert kv.allocate_slots(a, 8) and kv.allocate_slots(t, 8)
    log.take()
    kv.reset_prefix_cache("tenant", all_namespaces=False)
    (ev,) = log.take()
    assert isinstance(ev, BlockRemoved) and ev.block_hashes == [to_u64(h) for h in t.block_hashes]


def test_vllm_hashes_match_a_reference_cbor_encoder() -> None:
    cbor2 = pytest.importorskip("cbor2")

    def ref(payload: object) -> int:
        return int.from_bytes(hashlib.sha256(cbor2.dumps(payload, canonical=True)).digest()[-8:], "big")

    for value in (None, 0, 23, 24, 255, 256, 65535, 65536, 2**32, 2**64 - 1, "seed", b"xy",
                  [1, [2, 70000], None], ["ns"]):
        assert cbor(value) == cbor2.dumps(value, canonical=True), value
    tokens = [5, 300, 70000, 49151] * 3
    parent = ref("42")
    expected = []
    for i in range(3):
        parent = ref([parent, tokens[i * BS:(i + 1) * BS], ["t"] if i == 0 else None])
        expected.append(parent)
    assert vllm_block_hashes(tokens, BS, seed="42", namespace="t") == expected

    kv = KVCacheManager(8, BS, fingerprint="fp")
    log = KVEventLog(BS, ExternalHashing("vllm", seed="42"))
    kv.enable_events(log)
    r = req("r", tokens, salt="t")
    assert kv.allocate_slots(r, len(tokens))
    (ev,) = log.take()
    assert ev.block_hashes == expected and ev.parent_block_hash is None
    kv.reset_prefix_cache("t", all_namespaces=False)
    (gone,) = log.take()
    assert sorted(gone.block_hashes) == sorted(expected)


def test_unknown_hashing_is_rejected() -> None:
    with pytest.raises(ValueError, match="block hashing"):
        ExternalHashing("md5")
