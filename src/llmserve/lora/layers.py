"""The LoRA wrapper of one (fused) ``Linear``: a slot table of stacked low-rank weights.

``LoraLinear`` keeps the base layer (any :class:`~llmserve.model.layers.linear.LinearMethod`:
dense, int8, int4, GGUF-packed) and adds, per adapter slot the step uses, the delta of that
slot's rows with two dense products::

    a   [S*k*R, in]    slot s, shard j, rank row r  ->  row (s*k + j)*R + r   (A of that shard)
    bt  [S, out, k*R]  slot s: scaling * B of shard j in shard j's output rows, columns j*R..
    rows_s             the step's token rows under the adapter in slot s (index, ascending)

    y = base(x);  y[rows_s] += (x[rows_s] @ a_s^T) @ bt_s^T      for each slot s of the step

``S`` = ``max_loras`` slots, ``k`` = shards of the fused layer (3 for q/k/v, 2 for gate/up,
1 otherwise), ``R`` = ``max_lora_rank`` (a smaller rank leaves zero columns). ``bt`` is
block-diagonal over shards, so a q-only adapter leaves k and v untouched; base-model tokens
(adapter index 0) are in no group and keep ``base(x)``.

A token's delta is the same bits whatever else is in its step: each product sees only its
slot's rows, in fixed shapes but for the row count, and runs the tier library's ``f32_mm``
(one sum order at every row count; float32 slots, packed beside the plain ones) or PyTorch's
GEMM over the rows padded to its row granule (gemm_row_granule), at which a row sums as it
does alone. (The mask over all slots
this replaced summed a row's rank products with the other slots' zeros, and its GEMMs by the
row count: a LoRA request's logits moved by ~6e-6 with its batch.) The loop runs over the
step's adapters, at most ``max_loras``.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.model.layers.gemm_row_granule import dtype_kind, pad_rows, row_granule
from llmserve.model.layers.linear import Linear
from llmserve.model.layers.native_dense import f32_mm, native_f32_available, pack_f32


class LoraStepState:
    """The per-step input every wrapped layer of one model reads (set by :meth:`set`)."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.active = False                  # any adapter in this step
        #: (slot, the token rows under it) for each slot the step uses, slots ascending
        self.groups: list[tuple[int, torch.Tensor]] = []

    def set(self, seq_index: list[int], query_lens: list[int], device: torch.device) -> None:
        """Per sequence its adapter index (0: base, s + 1: slot s) and token count."""
        used = sorted({i for i in seq_index if i})
        self.active = bool(used)
        self.groups = []
        if not used:
            return
        per_token = torch.repeat_interleave(torch.tensor(seq_index), torch.tensor(query_lens))
        self.groups = [(i - 1, (per_token == i).nonzero().flatten().to(device)) for i in used]

    def clear(self) -> None:
        self.active = False
        self.groups = []


class LoraLinear(nn.Module):
    """``base(x)`` plus the batched LoRA delta of each token's adapter slot."""

    def __init__(self, base: Linear, state: LoraStepState, num_slots: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.base = base
        self.state = state
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.num_shards = len(base.output_sizes)
        self.input_size = base.input_size
        self.output_sizes = base.output_sizes
        self.output_size = base.output_size
        self.width = self.num_shards * max_rank     # rank columns of one slot
        self.register_buffer("a", torch.zeros(num_slots * self.width, base.input_size,
                                              dtype=dtype, device=device), persistent=False)
        self.register_buffer("bt", torch.zeros(num_slots, base.output_size, self.width,
                                               dtype=dtype, device=device), persistent=False)
        # float32 slots on a CPU tier with ``f32_mm`` (one sum order at every row count) keep
        # packed copies for it; otherwise PyTorch's GEMMs over rows padded to their granule
        # (1 off the CPU: no padding)
        self.native = (device.type == "cpu" and dtype == torch.float32
                       and native_f32_available())
        self.packed: list[tuple[torch.Tensor, torch.Tensor]] = [
            self._pack(slot) for slot in range(num_slots)] if self.native else []
        self.stale: set[int] = set()   # slots written since they were last packed
        self.granule = row_granule(dtype_kind(dtype)) \
            if device.type == "cpu" and not self.native else 1

    def _pack(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (pack_f32(self.a[slot * self.width:(slot + 1) * self.width]),
                pack_f32(self.bt[slot]))

    def shard_columns(self, shard: Optional[int]) -> tuple[int, int]:
        """(first output column, width) of ``shard`` (None: the whole output)."""
        if shard is None:
            return 0, self.output_size
        return sum(self.output_sizes[:shard]), self.output_sizes[shard]

    def clear_slot(self, slot: int) -> None:
        self.a[slot * self.width:(slot + 1) * self.width].zero_()
        self.bt[slot].zero_()
        self.stale.add(slot)

    def set_shard(self, slot: int, shard: Optional[int], lora_a: torch.Tensor,
                  lora_b: torch.Tensor, scaling: float) -> None:
        """Write one shard of an adapter: ``A [r, in]``, ``B [out_shard, r]`` into ``slot``."""
        r = lora_a.shape[0]
        j = 0 if shard is None else shard
        col, width = self.shard_columns(shard)
        self.a[slot * self.width + j * self.max_rank:][:r].copy_(lora_a)
        self.bt[slot, col:col + width, j * self.max_rank:j * self.max_rank + r].copy_(
            lora_b * scaling)
        self.stale.add(slot)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if not self.state.active:
            return y
        if self.stale and self.native:   # pack each written slot once, after all its shards
            for slot in self.stale:
                self.packed[slot] = self._pack(slot)
        self.stale.clear()
        for slot, rows in self.state.groups:
            whole = rows.shape[0] == x.shape[0]    # the slot has every row of the step
            xs = (x if whole else x.index_select(0, rows)).to(self.a.dtype)
            if self.native:
                packed_a, packed_bt = self.packed[slot]
                delta = f32_mm(f32_mm(xs, packed_a, self.width), packed_bt,
                               self.output_size).to(y.dtype)
            else:   # both products over the rows padded once (eager steps: plain calls)
                padded = pad_rows(xs, self.granule)
                a = self.a[slot * self.width:(slot + 1) * self.width]
                delta = F.linear(F.linear(padded, a), self.bt[slot])[:xs.shape[0]].to(y.dtype)
            y = y + delta if whole else y.index_add(0, rows, delta)
        return y

    @property
    def weight_bytes(self) -> int:
        """The base layer's weights (the adapter slots are counted by the LoRA manager)."""
        return self.base.weight_bytes

    @property
    def slot_bytes(self) -> int:
        packed = sum(t.numel() * t.element_size() for pair in self.packed for t in pair)
        return (self.a.numel() * self.a.element_size() + self.bt.numel() * self.bt.element_size()
                + packed)

    def extra_repr(self) -> str:
        return f"slots={self.num_slots}, max_rank={self.max_rank}, shards={self.num_shards}"
