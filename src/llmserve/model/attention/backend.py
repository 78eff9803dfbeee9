"""The attention backend interface: metadata built once per step, forward once per layer.

The runner lays a step's tokens out decodes first, then prefill chunks::

    tokens:  [d0 d1 ... d_{Bd-1} | p0 p0 p0 p0 | p1 p1 | ... ]
              one query each       chunk of seq Bd, of seq Bd+1 ...

and hands the backend a :class:`StepBatch` (index tensors on the device plus their host
copies). ``build_metadata`` turns it into whatever the backend's kernels index with, once for
all layers; ``forward`` writes the new K/V through ``slot_mapping`` and attends. A decode-only
step may instead come through ``decode_metadata`` (pure tensor ops, traced into the compiled
step). Backends: ``reference`` (gather + SDPA, the yardstick) and ``paged`` (decodes read the
paged cache in place when compiled).

KV cache per layer: ``(num_slots, kv_heads, head_dim)``, slot = block * block_size + offset;
an int8/fp8 cache has ``head_dim + 4`` (codes, then a float32 scale: llmserve.model.quant.kv),
and every read goes through ``load_kv``, every write through ``store_kv``.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from llmserve.model.layers.cpu_kernels import stored_rows
from llmserve.model.quant.kv import load_kv, store_kv


@dataclass
class StepBatch:
    """Index tensors of one step (device) and the host lists they came from."""

    slot_mapping: torch.Tensor      # (T,) long
    block_tables: torch.Tensor      # (B, W) long, padded with a scratch block
    context_lens: torch.Tensor      # (B,) long: cached + new tokens
    num_decodes: int                # sequences [0, num_decodes) compute one token each
    query_lens: list[int]           # host: new tokens per sequence
    context_lens_host: list[int]
    table_widths: list[int]         # host: blocks each sequence really uses


@dataclass
class GroupMetadata:
    """One run of sequences attended by a single SDPA call (reference layout).

    Sequences are grouped by block-table width (and chunk length) in powers of two, so
    padding stays under 2x whatever mix of long and short contexts a step holds.
    """

    token_start: int               # the group's first row in the flat token batch
    num_tokens: int                # its rows (decode: one per sequence)
    block_ids: torch.Tensor        # (B, W) long
    mask: torch.Tensor             # (B, 1, Q, W * block_size) bool
    query_index: Optional[torch.Tensor] = None   # prefill: (B*Qmax,) row of each padded query
    output_index: Optional[torch.Tensor] = None  # prefill: (N,) padded row of each real query
    max_query: int = 1
    query_pos: Optional[torch.Tensor] = None     # (B, 1, Q, 1) position of each query
    key_pos: Optional[torch.Tensor] = None       # (W * block_size,) position of each key
    _step_cache: dict = field(default_factory=dict)   # see cached()

    @property
    def is_decode(self) -> bool:
        return self.query_index is None

    def mask_for(self, window: Optional[int]) -> torch.Tensor:
        """The group's mask, restricted to keys in ``(pos - window, pos]`` when ``window``."""
        if window is None:
            return self.mask
        return self.cached(window, lambda: self.mask & (self.key_pos > self.query_pos - window))

    def cached(self, key: object, build: Callable[[], Any]) -> Any:
        """``build()`` once per step for this group and ``key`` (every layer reuses it)."""
        value = self._step_cache.get(key)
        if value is None:
            value = self._step_cache[key] = build()
        return value


@dataclass
class AttentionMetadata:
    """What every layer's attention needs for one step."""

    slot_mapping: torch.Tensor
    block_size: int
    groups: list[GroupMetadata] = field(default_factory=list)
    # decode rows handled as one batch (paged backend; also the compiled decode step)
    num_decodes: int = 0
    decode_block_tables: Optional[torch.Tensor] = None   # (Bd, W)
    decode_valid: Optional[torch.Tensor] = None          # (Bd, W * block_size) bool
    decode_slots: Optional[torch.Tensor] = None          # (Bd, W * block_size) long: cache rows
    decode_context_lens: Optional[torch.Tensor] = None   # (Bd,) long
    # a compiled verify step: Q query rows per sequence (decode_valid is then (B, Q, L))
    decode_positions: Optional[torch.Tensor] = None      # (B, Q) long: each row's position
    _windowed: dict = field(default_factory=dict)

    def decode_valid_for(self, window: Optional[int]) -> torch.Tensor:
        """``decode_valid`` restricted to the last ``window`` keys of each row when ``window``."""
        if window is None:
            return self.decode_valid
        valid = self._windowed.get(window)
        if valid is None:
            keys = torch.arange(self.decode_valid.shape[-1], device=self.decode_valid.device)
            if self.decode_positions is not None:
                last = self.decode_positions.unsqueeze(-1)
            else:
                last = self.decode_context_lens.unsqueeze(1) - 1
            valid = self.decode_valid & (keys > last - window)
            self._windowed[window] = valid
        return valid


class AttentionBackend(ABC):
    """Computes attention for all layers of a step over the paged KV cache."""

    name = "abstract"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.block_size = block_size

    @abstractmethod
    def build_metadata(self, batch: StepBatch) -> AttentionMetadata:
        """Index tensors for one step (any mix of decodes and prefill chunks)."""

    def decode_metadata(self, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                        context_lens: torch.Tensor) -> AttentionMetadata:
        """Metadata of a decode-only step from tensors alone (traceable by torch.compile).
        Inside a compiled CPU graph the key table and mask are stored once
        (``stored_rows``): inductor would otherwise recompute them in every layer's fused
        kernel, as many times as the model has layers."""
        bs = self.block_size
        b, w = block_tables.shape
        keys = torch.arange(w * bs, device=block_tables.device)
        valid = stored_rows(keys.unsqueeze(0) < context_lens.unsqueeze(1))
        slots = stored_rows((block_tables.unsqueeze(-1) * bs + keys[:bs]).view(b, w * bs))
        return AttentionMetadata(slot_mapping=slot_mapping, block_size=bs, num_decodes=b,
                                 decode_block_tables=block_tables, decode_valid=valid,
                                 decode_slots=slots, decode_context_lens=context_lens)

    def verify_metadata(self, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                        positions: torch.Tensor) -> AttentionMetadata:
        """Metadata of a step of ``B`` sequences with ``Q`` query rows each (a decode with
        drafts; ``positions (B, Q)``), from tensors alone: row ``(b, j)`` attends to the
        keys at positions ``<= positions[b, j]`` (causal within its own rows)."""
        bs = self.block_size
        b, w = block_tables.shape
        keys = torch.arange(w * bs, device=block_tables.device)
        valid = stored_rows(keys <= positions.unsqueeze(-1))              # (B, Q, L)
        slots = stored_rows((block_tables.unsqueeze(-1) * bs + keys[:bs]).view(b, w * bs))
        return AttentionMetadata(slot_mapping=slot_mapping, block_size=bs,
                                 num_decodes=positions.numel(), decode_block_tables=block_tables,
                                 decode_valid=valid, decode_slots=slots,
                                 decode_positions=positions)

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float, window: Optional[int] = None,
                softcap: Optional[float] = None) -> torch.Tensor:
        """``q (T, H, D)``, new ``k``/``v (T, Hkv, D)`` -> attention output ``(T, H * D)``.

        ``window``: attend only to the last ``window`` positions (the query's own included);
        ``softcap``: cap the scaled scores at ``softcap * tanh(s / softcap)``.
        """


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store the new tokens' K/V at their slots (cast to the cache dtype, or quantized)."""
    store_kv(k_cache, slot_mapping, k)
    store_kv(v_cache, slot_mapping, v)


def capped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     mask: torch.Tensor, scale: float, softcap: float) -> torch.Tensor:
    """Attention with soft-capped scores: ``q (B, H, Q, D)``, ``keys/values (B, Hkv, L, D)``,
    ``mask (B, 1, Q, L)`` bool -> ``(B, H, Q, D)``. Query heads share KV heads in groups of
    ``H / Hkv`` (adjacent heads), as in SDPA's ``enable_gqa``."""
    b, h, nq, d = q.shape
    hkv = keys.shape[1]
    q5 = q.reshape(b, hkv, h // hkv, nq, d)
    scores = torch.matmul(q5, keys.unsqueeze(2).transpose(-1, -2)) * scale   # (B,Hkv,G,Q,L)
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask.unsqueeze(2), float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return torch.matmul(probs, values.unsqueeze(2)).reshape(b, h, nq, values.shape[-1])


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor, block_size: int,
                  dtype: torch.dtype) -> torch.Tensor:
    """(B, W) block tables -> (B, kv_heads, W * block_size, head_dim) keys or values.

    One ``index_select`` of whole blocks (contiguous rows of block_size * kv_heads * head_dim
    elements), which streams at memory speed.
    """
    b, w = block_ids.shape
    _, hkv, d = cache.shape     # d: head_dim, or head_dim + 4 in a quantized cache
    rows = cache.view(-1, block_size * hkv * d).index_select(0, block_ids.flatten())
    return load_kv(rows.view(b, w * block_size, hkv, d), dtype).transpose(1, 2)


def make_backend(name: str, num_heads: int, num_kv_heads: int, head_dim: int,
                 block_size: int, dtype: torch.dtype = torch.float32,
                 kv_dtype: Optional[torch.dtype] = None,
                 device: Optional[torch.device] = None) -> AttentionBackend:
    """The backend called ``name`` (``reference`` | ``paged``) for queries of ``dtype`` over
    a cache of ``kv_dtype`` (default: ``dtype``) on ``device`` (default: the CPU): what the
    paged backend needs to pick its decode kernel once, here."""
    from llmserve.model.attention.paged import PagedBackend
    from llmserve.model.attention.reference import ReferenceBackend

    if name == "paged":
        return PagedBackend(num_heads, num_kv_heads, head_dim, block_size, dtype,
                            dtype if kv_dtype is None else kv_dtype, device)
    if name == "reference":
        return ReferenceBackend(num_heads, num_kv_heads, head_dim, block_size)
    raise ValueError(f"unknown attention backend {name!r}; use one of ['paged', 'reference']")
