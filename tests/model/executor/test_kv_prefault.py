"""Committing the KV pool's next blocks in the background (model/executor/kv_prefault.py):
pages become resident without a byte changing, only while no step runs, never past the
target; an engine that prefaults answers as one that does not."""
from __future__ import annotations

import ctypes
import mmap
import sys
import threading
import time

import numpy as np
import pytest
import torch

from llmserve import SamplingParams
from llmserve.model.executor.kv_prefault import (
    KVPrefaulter,
    _madvise,
    populate,
    prefault_target,
)
from tests.model.tiny_checkpoints import make_tiny_checkpoint

PAGE = 4096
needs_populate = pytest.mark.skipif(not sys.platform.startswith("linux") or _madvise() is None,
                                    reason="madvise(MADV_POPULATE_WRITE) is Linux-only")


def resident_pages(t: torch.Tensor, first_byte: int, end_byte: int) -> np.ndarray:
    """mincore's residency flag of each page of ``t``'s bytes [first_byte, end_byte)."""
    libc = ctypes.CDLL(None, use_errno=True)
    start = t.data_ptr() + first_byte
    lo = start - start % PAGE
    hi = -(-(t.data_ptr() + end_byte) // PAGE) * PAGE
    vec = (ctypes.c_ubyte * ((hi - lo) // PAGE))()
    if libc.mincore(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), vec) != 0:
        pytest.skip(f"mincore failed (errno {ctypes.get_errno()})")
    return np.frombuffer(vec, dtype=np.uint8) & 1


_maps: list[mmap.mmap] = []   # kept alive with the tensors viewing them


def lazy_cache(blocks: int, block_bytes: int) -> torch.Tensor:
    """A pool-like tensor of fresh anonymous memory: its pages appear when written, as
    the engine's calloc'd pool's do (kv_cache.py)."""
    m = mmap.mmap(-1, blocks * block_bytes)
    _maps.append(m)
    return torch.frombuffer(m, dtype=torch.uint8).view(blocks, -1)


@needs_populate
def test_populate_makes_the_blocks_resident_without_changing_a_byte():
    block = 3 * PAGE + 512                       # blocks that straddle page boundaries
    cache = lazy_cache(64, block)
    cache[10, -100:] = 7                         # a block in use, sharing a page with 11
    assert resident_pages(cache, 12 * block, 40 * block).sum() == 0
    assert populate([cache], 11, 40, block)
    assert resident_pages(cache, 11 * block, 40 * block).all()
    assert resident_pages(cache, 45 * block, 64 * block).sum() == 0   # past the range
    assert bool((cache[10, -100:] == 7).all()) and int(cache.sum()) == 700


@needs_populate
def test_the_prefaulter_waits_for_idle_time_and_stops_at_its_target():
    block = 2 * PAGE
    caches = [lazy_cache(256, block) for _ in range(3)]
    busy = threading.Event()
    busy.set()
    last_end = [time.monotonic()]
    p = KVPrefaulter(caches, block, start=8, target=200, busy=busy.is_set,
                     last_step_end=lambda: last_end[0], chunk=16, idle_s=0.02).start()
    try:
        time.sleep(0.2)
        assert p.committed == 8                  # a step runs: nothing is committed
        busy.clear()
        last_end[0] = time.monotonic()
        deadline = time.monotonic() + 10
        while not p.done and time.monotonic() < deadline:
            time.sleep(0.01)
        assert p.done and p.committed == 200
    finally:
        p.stop()
    for c in caches:
        assert resident_pages(c, 8 * block, 200 * block).all()
        assert resident_pages(c, 201 * block, 256 * block).sum() == 0
    assert all(int(c.sum()) == 0 for c in caches)


def test_the_prefault_target():
    # default: max_num_seqs x 256 tokens, capped at 1 GiB of KV and at the pool
    assert prefault_target(None, 64, 16, 1000, committed=320, num_blocks=32768) == 1024
    assert prefault_target(None, 64, 16, 4 << 20, committed=100, num_blocks=32768) == 256
    assert prefault_target(None, 64, 16, 1000, committed=320, num_blocks=500) == 500
    assert prefault_target(None, 4, 16, 1000, committed=320, num_blocks=32768) == 320
    # a setting: that many tokens past the committed blocks; 0 is off
    assert prefault_target(100, 64, 16, 1000, committed=320, num_blocks=32768) == 327
    assert prefault_target(0, 64, 16, 1000, committed=320, num_blocks=32768) == 320


def test_a_negative_prefault_setting_is_refused():
    from llmserve.config import CacheConfig
    with pytest.raises(ValueError, match="kv_cache_prefault_tokens"):
        CacheConfig(kv_cache_prefault_tokens=-1)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("prefault")), arch="llama",
                                num_heads=4, num_kv_heads=2, seed=11)


@needs_populate
def test_an_engine_commits_its_next_blocks_while_idle_and_answers_the_same(tiny_path):
    from llmserve import LLM
    params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0)
    prompts = [list(range(10 + i, 40 + i)) for i in range(6)]
    plain = LLM(tiny_path, num_kv_blocks=256, block_size=4, kv_cache_commit_tokens=8,
                kv_cache_prefault_tokens=0, enforce_eager=True)
    assert plain.engine.executor.prefault is None
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]

    llm = LLM(tiny_path, num_kv_blocks=256, block_size=4, kv_cache_commit_tokens=8,
              kv_cache_prefault_tokens=400, enforce_eager=True, check_invariants=True)
    p = llm.engine.executor.prefault
    assert p is not None and p.target == 2 + 100
    deadline = time.monotonic() + 20
    while not p.done and time.monotonic() < deadline:
        time.sleep(0.01)
    assert p.done
    k, _ = llm.engine.runner.kv_caches[0]
    block = k.stride(0) * k.element_size() * 4
    assert resident_pages(k, 2 * block, 102 * block).all()
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
    llm.engine.kv.check_invariants()
    llm.engine.executor.shutdown()
    assert not p._thread.is_alive()


def test_a_kernel_without_populate_stops_the_prefaulter_at_its_first_chunk(monkeypatch):
    import llmserve.model.executor.kv_prefault as kp

    calls = []

    def failing(addr, length, advice):
        calls.append((addr, length, advice))
        return -1
    monkeypatch.setattr(kp, "_madvise", lambda: failing)
    cache = torch.zeros(64, 4096, dtype=torch.uint8)
    assert not populate([cache], 0, 8, 4096)
    p = KVPrefaulter([cache], 4096, start=0, target=64, busy=lambda: False,
                     last_step_end=lambda: 0.0, chunk=8).start()
    p._thread.join(5)
    assert not p._thread.is_alive() and p.committed == 0 and not p.done
    assert calls and all(advice == kp.MADV_POPULATE_WRITE for _, _, advice in calls)
    assert p.tensors == []                       # a finished thread keeps no pool tensor
