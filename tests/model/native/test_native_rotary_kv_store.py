"""llmserve_native::rotate_qk (csrc/rotary.cpp) and ::kv_store (csrc/kv_store.cpp): a
prefill chunk's rotary embedding and K/V writes, the same bits as PyTorch's."""
from __future__ import annotations

import pytest
import torch

from llmserve.model.attention.native_decode import kv_store_native, native_kv_store_available
from llmserve.model.layers.rotary import (
    RotaryEmbedding,
    native_rotate_qk,
    native_rotate_qk_available,
    rotate_qk,
)
from tests.model.native import needs_native


def _qk(rows: int, heads: int, kv_heads: int, d: int, seed: int = 0):
    """q and k as the attention passes them: views of one fused projection row."""
    gen = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(rows, (heads + 2 * kv_heads) * d, generator=gen) * 3).bfloat16()
    q = qkv[:, :heads * d].view(rows, heads, d)
    k = qkv[:, heads * d:(heads + kv_heads) * d].view(rows, kv_heads, d)
    return q, k


def _table(positions: int, d: int, theta: float = 10000.0) -> torch.Tensor:
    return RotaryEmbedding(d, positions, theta, None, torch.device("cpu")).cos_sin


@needs_native
@pytest.mark.parametrize("rows,heads,kv_heads,d", [(1, 9, 3, 64), (416, 9, 3, 64),
                                                   (70, 32, 8, 128), (65, 4, 2, 80),
                                                   (3, 2, 1, 32)])
def test_rotate_qk_gives_pytorchs_bits(rows, heads, kv_heads, d):
    q, k = _qk(rows, heads, kv_heads, d, seed=rows)
    table = _table(4096, d, theta=500000.0)
    positions = torch.randint(0, 4096, (rows,), generator=torch.Generator().manual_seed(1))
    want_q, want_k = rotate_qk(table, positions, q, k)
    got_q, got_k = native_rotate_qk(table, positions, q, k)
    assert got_q.shape == q.shape and got_k.shape == k.shape
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


@needs_native
def test_rotate_qk_keeps_a_rows_bits_in_any_batch():
    q, k = _qk(300, 9, 3, 64, seed=5)
    table = _table(512, 64)
    positions = torch.arange(300) + 100
    whole_q, whole_k = native_rotate_qk(table, positions, q, k)
    for r in (0, 17, 299):
        one_q, one_k = native_rotate_qk(table, positions[r:r + 1], q[r:r + 1], k[r:r + 1])
        assert torch.equal(one_q, whole_q[r:r + 1]) and torch.equal(one_k, whole_k[r:r + 1])


@needs_native
def test_rotate_qk_rejects_a_position_outside_its_table_and_odd_layouts():
    q, k = _qk(4, 2, 1, 64)
    table = _table(16, 64)
    with pytest.raises(RuntimeError, match="outside the table"):
        native_rotate_qk(table, torch.tensor([0, 1, 16, 2]), q, k)
    with pytest.raises(RuntimeError, match="contiguous heads"):
        native_rotate_qk(table, torch.arange(4), q.transpose(0, 1).transpose(0, 1)[:, :, ::2], k)
    with pytest.raises(RuntimeError, match="float32 table"):
        native_rotate_qk(table.bfloat16(), torch.arange(4), q, k)


@needs_native
def test_the_rotary_module_takes_the_native_kernel_for_bf16_cpu_rows():
    assert native_rotate_qk_available()
    rope = RotaryEmbedding(64, 128, 10000.0, None, torch.device("cpu"))
    assert rope.compile_rows(torch.bfloat16, torch.device("cpu"))
    assert rope.rows_rotary is native_rotate_qk
    q, k = _qk(80, 9, 3, 64, seed=9)
    positions = torch.arange(80)
    got, want = rope(positions, q, k), rotate_qk(rope.cos_sin, positions, q, k)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@needs_native
@pytest.mark.parametrize("rows", [1, 9, 416])
def test_kv_store_writes_the_bytes_of_index_copy(rows):
    gen = torch.Generator().manual_seed(rows)
    cache = torch.randn(1024, 3, 64, generator=gen).bfloat16()
    want = cache.clone()
    qkv = torch.randn(rows, 960, generator=gen).bfloat16()
    v = qkv[:, 768:].view(rows, 3, 64)                   # a strided view, as V is
    slots = torch.randperm(1024, generator=gen)[:rows]
    want.index_copy_(0, slots, v)
    kv_store_native(cache, slots, v)
    assert torch.equal(cache, want)


@needs_native
def test_kv_store_rejects_a_slot_outside_the_cache_and_leaves_it_unchanged():
    assert native_kv_store_available()
    cache = torch.zeros(32, 2, 64, dtype=torch.bfloat16)
    x = torch.ones(2, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="outside the cache"):
        kv_store_native(cache, torch.tensor([3, 32]), x)
    assert int(cache.count_nonzero()) == 0
    with pytest.raises(RuntimeError, match="bf16"):
        kv_store_native(cache.float(), torch.tensor([3, 4]), x.float())
