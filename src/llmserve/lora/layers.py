"""The LoRA wrapper of one (fused) ``Linear``: a slot table of stacked low-rank weights.

``LoraLinear`` keeps the base layer (any :class:`~llmserve.model.layers.linear.LinearMethod`:
dense, int8, int4, GGUF-packed) and adds the adapters' delta with two dense matmuls over
*all* slots, then a per-token one-hot mask picks each row's slot::

    a  [S*k*R, in]    slot s, shard j, rank row r  ->  row (s*k + j)*R + r   (A of that shard)
    b  [S*k*R, out]   the same rows: scaling * B^T of shard j, in shard j's output columns
    mask [T, S]       mask[t, s] = 1 when token t runs under the adapter in slot s
                      (a base-model token -- adapter index 0 -- has an all-zero row)

    y = base(x) + ((x @ a^T).view(T, S, k*R) * mask[:, :, None]).view(T, S*k*R) @ b

``S`` = ``max_loras`` slots, ``k`` = shards of the fused layer (3 for q/k/v, 2 for gate/up,
1 otherwise), ``R`` = ``max_lora_rank`` (a smaller rank leaves zero rows). One batch holds
several adapters and the base without a per-request loop; ``b`` is block-diagonal over
shards, so a q-only adapter leaves k and v untouched. Two cheaper cases of the same sum,
set once per step by :class:`LoraStepState`: only the slot range ``lo .. lo+n`` the step
uses is multiplied (rows of ``a``/``b`` are contiguous per slot), and when every token runs
the same adapter the mask is dropped. A step without adapters runs only the base.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from llmserve.model.layers.linear import Linear


class LoraStepState:
    """The per-step input every wrapped layer of one model reads (set by :meth:`set`)."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.active = False                  # any adapter in this step
        self.lo, self.n = 0, num_slots       # the slot range the step uses
        #: (tokens, n) one-hot in the model dtype; None: every token uses slot ``lo``
        self.mask: Optional[torch.Tensor] = None

    def set(self, seq_index: list[int], query_lens: list[int], dtype: torch.dtype,
            device: torch.device) -> None:
        """Per sequence its adapter index (0: base, s + 1: slot s) and token count."""
        used = {i for i in seq_index if i}
        self.active = bool(used)
        self.mask = None
        if not used:
            return
        self.lo, self.n = min(used) - 1, max(used) - min(used) + 1
        if len(used) == 1 and 0 not in seq_index:
            return   # one adapter for every token: no mask
        per_token = torch.repeat_interleave(torch.tensor(seq_index), torch.tensor(query_lens))
        onehot = torch.nn.functional.one_hot(per_token, self.num_slots + 1)
        self.mask = onehot[:, 1 + self.lo:1 + self.lo + self.n].to(device=device, dtype=dtype)

    def clear(self) -> None:
        self.active = False
        self.mask = None


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
        rows = num_slots * self.num_shards * max_rank
        self.register_buffer("a", torch.zeros(rows, base.input_size, dtype=dtype,
                                              device=device), persistent=False)
        self.register_buffer("b", torch.zeros(rows, base.output_size, dtype=dtype,
                                              device=device), persistent=False)

    def shard_columns(self, shard: Optional[int]) -> tuple[int, int]:
        """(first output column, width) of ``shard`` (None: the whole output)."""
        if shard is None:
            return 0, self.output_size
        return sum(self.output_sizes[:shard]), self.output_sizes[shard]

    def clear_slot(self, slot: int) -> None:
        rows = self.num_shards * self.max_rank
        self.a[slot * rows:(slot + 1) * rows].zero_()
        self.b[slot * rows:(slot + 1) * rows].zero_()

    def set_shard(self, slot: int, shard: Optional[int], lora_a: torch.Tensor,
                  lora_b: torch.Tensor, scaling: float) -> None:
        """Write one shard of an adapter: ``A [r, in]``, ``B [out_shard, r]`` into ``slot``."""
        r = lora_a.shape[0]
        j = 0 if shard is None else shard
        row = (slot * self.num_shards + j) * self.max_rank
        col, width = self.shard_columns(shard)
        self.a[row:row + r].copy_(lora_a)
        self.b[row:row + r, col:col + width].copy_(lora_b.t() * scaling)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        st = self.state
        if not st.active:
            return y
        t = x.shape[0]
        width = self.num_shards * self.max_rank
        rows = slice(st.lo * width, (st.lo + st.n) * width)
        xa = torch.nn.functional.linear(x.to(self.a.dtype), self.a[rows])
        if st.mask is not None:
            xa = (xa.view(t, st.n, width) * st.mask[:t, :, None]).view(t, -1)
        if y.dtype != xa.dtype:
            return y + (xa @ self.b[rows]).to(y.dtype)
        return torch.addmm(y, xa, self.b[rows])

    @property
    def weight_bytes(self) -> int:
        """The base layer's weights (the adapter slots are counted by the LoRA manager)."""
        return self.base.weight_bytes

    @property
    def slot_bytes(self) -> int:
        return self.a.numel() * self.a.element_size() + self.b.numel() * self.b.element_size()

    def extra_repr(self) -> str:
        return f"slots={self.num_slots}, max_rank={self.max_rank}, shards={self.num_shards}"
