"""Huge pages for the weights and the KV pool (model/executor/huge_pages.py): which address
ranges are asked for, that a collapse keeps every byte and maps 2 MB pages where the kernel
allows it, that a pool advised before its first write faults in huge pages, that
``LLMSERVE_HUGE_PAGES=0`` turns both off, and that an engine reports where its memory
landed (the plan, not the fingerprint: pages change no arithmetic)."""
from __future__ import annotations

import mmap
import platform

import pytest
import torch

from llmserve.model.executor import huge_pages as hp
from tests.model.tiny_checkpoints import make_tiny_checkpoint

MB2 = 2 << 20
THP_ON = hp.thp_setting() in ("always", "madvise")


def _huge_kb_at(address: int) -> int:
    """AnonHugePages (kB) of the mapping that holds ``address`` in /proc/self/smaps."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1])
    return 0


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("pages")), arch="llama",
                                num_heads=4, num_kv_heads=2, seed=11)


def test_ranges_are_aligned_inside_their_spans_and_small_gaps_join_only_when_asked():
    size = MB2
    spans = [(size + 100, 3 * size + 5),            # one whole huge page inside: [2M, 3M)
             (3 * size + 4096, 5 * size - 1),       # a page's gap from the first
             (9 * size, 9 * size + 4096)]           # too small for any huge page
    assert hp.aligned_ranges(spans, size, join_gaps=False) == [(2 * size, 3 * size)]
    joined = hp.aligned_ranges(spans, size, join_gaps=True)
    assert joined == [(2 * size, 4 * size)]         # the gap joined: [1M+100, 5M-1) aligned
    assert hp.aligned_ranges([(5, 5), (10, 3)], size, join_gaps=True) == []


def test_the_setting_turns_huge_pages_off(monkeypatch):
    t = torch.ones(3 * MB2 // 4, dtype=torch.int32)
    monkeypatch.setenv("LLMSERVE_HUGE_PAGES", "0")
    assert not hp.huge_pages_enabled()
    assert hp.collapse_huge_pages([t]) == (0, 0)
    assert hp.advise_huge_pages([t]) == 0


@pytest.mark.skipif(not THP_ON, reason="the kernel's transparent huge pages are off")
def test_a_collapse_keeps_every_byte_and_maps_huge_pages(monkeypatch):
    monkeypatch.delenv("LLMSERVE_HUGE_PAGES", raising=False)
    g = torch.Generator().manual_seed(0)
    # written on 4 KB pages in a fresh private mapping (the process's heap may hold huge
    # pages already); one big tensor, then two small ones a few bytes apart
    area = mmap.mmap(-1, 6 * MB2, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    flat = torch.frombuffer(area, dtype=torch.int8)
    flat.copy_(torch.randint(-128, 127, (6 * MB2,), dtype=torch.int8, generator=g))
    weights = [flat[:5 * MB2], flat[5 * MB2 + 64:5 * MB2 + 300_064],
               flat[5 * MB2 + 300_128:5 * MB2 + 1_000_000]]
    before = [w.clone() for w in weights]
    huge_before = _huge_kb_at(weights[0].data_ptr() + 2 * MB2)
    done, tried = hp.collapse_huge_pages(weights)
    assert tried >= 4 * MB2 and 0 <= done <= tried
    assert all(torch.equal(a, b) for a, b in zip(weights, before))
    if tuple(int(x) for x in platform.release().split(".")[:2]) < (6, 1):
        pytest.skip("MADV_COLLAPSE needs Linux 6.1+")
    assert done >= 4 * MB2
    if hp.thp_setting() == "madvise":   # with "always" the writes may have mapped them huge
        assert _huge_kb_at(weights[0].data_ptr() + 2 * MB2) >= huge_before + 4 * 2048
    del weights, before, flat
    area.close()


@pytest.mark.skipif(not THP_ON, reason="the kernel's transparent huge pages are off")
def test_memory_advised_before_its_first_write_faults_in_huge_pages(monkeypatch):
    monkeypatch.delenv("LLMSERVE_HUGE_PAGES", raising=False)
    # a fresh anonymous mapping, never written (not numpy's, which advises its own large
    # arrays; not malloc's, which may hand back memory written before)
    area = mmap.mmap(-1, 8 * MB2, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    pool = torch.frombuffer(area, dtype=torch.uint8)
    huge_before = _huge_kb_at(pool.data_ptr() + 3 * MB2)
    assert hp.advise_huge_pages([pool]) >= 6 * MB2
    pool.fill_(0)
    pool[2 * MB2:6 * MB2].fill_(7)
    assert int(pool.sum()) == 7 * 4 * MB2
    assert _huge_kb_at(pool.data_ptr() + 3 * MB2) >= huge_before + 3 * 2048
    del pool
    area.close()


def test_an_engine_reports_its_pages_in_the_plan_and_not_in_the_fingerprint(
        tiny_path, monkeypatch):
    from llmserve.llm import LLM
    from llmserve.model.executor.kernel_plan import format_kernel_plan
    from llmserve.sampling_params import SamplingParams

    def engine(setting: str) -> LLM:
        monkeypatch.setenv("LLMSERVE_HUGE_PAGES", setting)
        return LLM(tiny_path, dtype="float32", num_kv_blocks=4000, block_size=16,
                   enforce_eager=True)

    on, off = engine("1"), engine("0")
    pages_on = on.engine.runner.kernel_plan["cpu"]["huge_pages"]
    pages_off = off.engine.runner.kernel_plan["cpu"]["huge_pages"]
    assert pages_off["weights_bytes"] == 0 and pages_off["kv_pool_bytes"] == 0
    assert pages_on["thp"] == hp.thp_setting()
    if THP_ON:
        assert pages_on["kv_pool_bytes"] > 0        # 4000 blocks of each layer's K span > 2 MB
    assert "2 MB pages" in format_kernel_plan(on.engine.runner.kernel_plan, "eager")
    assert on.engine.fingerprint == off.engine.fingerprint
    params = SamplingParams(max_tokens=6, temperature=0.0)
    a = on.generate([[5, 6, 7, 8]], params)[0].outputs[0].token_ids
    b = off.generate([[5, 6, 7, 8]], params)[0].outputs[0].token_ids
    assert a == b
