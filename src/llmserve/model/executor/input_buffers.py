"""Preallocated step inputs: host buffers filled in place, one host-to-device copy per step.

Every index array of a step lives in one int64 staging buffer::

    [ input_ids (T) | positions (T) | slot_mapping (T) | context_lens (B) | block_tables (B*W) ]

filled with numpy from the StepInput (O(tokens + B*W), no per-step allocation), then copied
to the device in one transfer (pinned memory on CUDA; on CPU the tensors are views of the
buffer, valid until the next step). Rows can be padded for the compiled step: padded
sequences read and write only the KV pool's scratch block.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from llmserve.engine.step_types import StepInput
from llmserve.model.attention.backend import StepBatch


@dataclass
class StagedStep:
    """One step's inputs on the device, in runner order, plus the host facts about them."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor          # (B_padded, W)
    num_seqs: int                       # real sequences (rows past it are padding)
    num_decodes: int
    query_lens: list[int]
    context_lens_host: list[int]
    table_widths: list[int]
    row_starts: list[int]               # first token row of each sequence (runner order)

    def batch(self) -> StepBatch:
        """The attention backend's view of this step."""
        return StepBatch(slot_mapping=self.slot_mapping, block_tables=self.block_tables,
                         context_lens=self.context_lens, num_decodes=self.num_decodes,
                         query_lens=self.query_lens, context_lens_host=self.context_lens_host,
                         table_widths=self.table_widths)


class InputBuffers:
    """Host staging for up to ``max_tokens`` tokens and ``max_seqs`` sequences."""

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int,
                 scratch_block: int, device: torch.device) -> None:
        self.max_tokens = max_tokens
        self.max_seqs = max_seqs
        self.max_blocks = max(2, max_blocks_per_seq)
        self.scratch_block = scratch_block
        self.device = device
        size = 3 * max_tokens + max_seqs + max_seqs * self.max_blocks
        self._host = torch.zeros(size, dtype=torch.int64,
                                 pin_memory=device.type == "cuda")
        self._np = self._host.numpy()
        self._arange = np.arange(max(max_tokens, self.max_blocks), dtype=np.int64)

    def _on_device(self, end: int) -> torch.Tensor:
        """The first ``end`` staged values on the device: one copy (a view on CPU)."""
        if self.device.type == "cpu":
            return self._host[:end]
        return self._host[:end].to(self.device, non_blocking=True)

    def _tables_shape(self, starts: list[int], qlens: list[int],
                      block_size: int) -> tuple[list[int], list[int], int]:
        """Context lengths, block-table widths and the staged width (at least 2: a dynamic
        dimension of the compiled graphs) of sequences after this step."""
        ctx = [s + n for s, n in zip(starts, qlens)]
        widths = [-(-c // block_size) for c in ctx]
        w = max(2, max(widths))
        if w > self.max_blocks:
            raise ValueError(f"a context of {max(ctx)} tokens exceeds the buffers")
        return ctx, widths, w

    def stage(self, step: StepInput, order: list[int], block_size: int,
              pad_to: Optional[int] = None) -> StagedStep:
        """Fill the buffers with ``step``'s sequences in ``order`` (padded to ``pad_to`` rows)."""
        b = len(order)
        rows = pad_to or b
        qlens = [step.num_new_tokens[i] for i in order]
        starts = [step.start_positions[i] for i in order]
        t = sum(qlens) + (rows - b)
        if t > self.max_tokens or rows > self.max_seqs:
            raise ValueError(f"step of {t} tokens / {rows} sequences exceeds the buffers "
                             f"({self.max_tokens} / {self.max_seqs})")
        ctx, widths, w = self._tables_shape(starts, qlens, block_size)
        buf = self._np
        o_ids, o_pos, o_slot, o_ctx = 0, t, 2 * t, 3 * t
        o_bt = o_ctx + rows
        end = o_bt + rows * w
        ids = buf[o_ids:o_pos]
        offsets, src = _token_offsets(step)
        decode_only = t == rows and all(n == 1 for n in qlens)
        if decode_only:
            ids[:b] = src[np.asarray(order, dtype=np.int64)] if b else 0
        else:
            pos_in = 0
            for i, n in zip(order, qlens):
                ids[pos_in:pos_in + n] = src[offsets[i]:offsets[i] + n]
                pos_in += n
        ids[t - (rows - b):] = 0
        row_starts = np.zeros(rows + 1, dtype=np.int64)
        np.cumsum(qlens + [1] * (rows - b), out=row_starts[1:])
        starts_np = np.asarray(starts + [0] * (rows - b), dtype=np.int64)
        lens_np = np.diff(row_starts)
        pos = buf[o_pos:o_slot]
        pos[:] = np.repeat(starts_np - row_starts[:-1], lens_np) + self._arange[:t]
        bt = buf[o_bt:end].reshape(rows, w)
        bt.fill(self.scratch_block)
        for p, i in enumerate(order):
            table = step.block_tables[i]
            bt[p, :len(table)] = table
        buf[o_ctx:o_ctx + b] = ctx
        buf[o_ctx + b:o_bt] = 1
        seq_of_token = np.repeat(self._arange[:rows], lens_np)
        buf[o_slot:o_ctx] = (bt[seq_of_token, pos // block_size] * block_size + pos % block_size)
        dev = self._on_device(end)
        num_decodes = 0
        for n in qlens:
            if n != 1:
                break
            num_decodes += 1
        return StagedStep(
            input_ids=dev[o_ids:o_pos], positions=dev[o_pos:o_slot],
            slot_mapping=dev[o_slot:o_ctx], context_lens=dev[o_ctx:o_bt],
            block_tables=dev[o_bt:end].view(rows, w), num_seqs=b,
            num_decodes=num_decodes + (rows - b), query_lens=qlens + [1] * (rows - b),
            context_lens_host=ctx + [1] * (rows - b),
            table_widths=widths + [1] * (rows - b), row_starts=row_starts[:-1].tolist())

    def stage_uniform(self, step: StepInput, order: list[int], block_size: int, rows: int,
                      seqs: int) -> StagedStep:
        """``step``'s sequences in ``order`` as ``seqs`` x ``rows`` query rows (a verify
        step: each sequence's tokens, then padding). A padded row repeats its sequence's
        last position and writes the scratch block; a padded sequence is all scratch."""
        b = len(order)
        t = seqs * rows
        qlens = [step.num_new_tokens[i] for i in order]
        starts = [step.start_positions[i] for i in order]
        if t > self.max_tokens or seqs > self.max_seqs or b > seqs or max(qlens) > rows:
            raise ValueError(f"a verify step of {b} x {max(qlens)} tokens does not fit "
                             f"{seqs} x {rows} rows of the buffers")
        ctx, widths, w = self._tables_shape(starts, qlens, block_size)
        buf = self._np
        o_pos, o_slot, o_ctx = t, 2 * t, 3 * t
        o_bt = o_ctx + seqs
        end = o_bt + seqs * w
        ids = buf[:o_pos].reshape(seqs, rows)
        pos = buf[o_pos:o_slot].reshape(seqs, rows)
        slot = buf[o_slot:o_ctx].reshape(seqs, rows)
        bt = buf[o_bt:end].reshape(seqs, w)
        ids.fill(0)
        pos.fill(0)
        slot.fill(self.scratch_block * block_size)
        bt.fill(self.scratch_block)
        offsets, src = _token_offsets(step)
        for p, (i, n, s0) in enumerate(zip(order, qlens, starts)):
            table = step.block_tables[i]
            bt[p, :len(table)] = table
            ids[p, :n] = src[offsets[i]:offsets[i] + n]
            pos[p, :n] = self._arange[:n] + s0
            pos[p, n:] = s0 + n - 1
            slot[p, :n] = bt[p, pos[p, :n] // block_size] * block_size + pos[p, :n] % block_size
        buf[o_ctx:o_ctx + b] = ctx
        buf[o_ctx + b:o_bt] = 1
        dev = self._on_device(end)
        return StagedStep(
            input_ids=dev[:o_pos], positions=dev[o_pos:o_slot], slot_mapping=dev[o_slot:o_ctx],
            context_lens=dev[o_ctx:o_bt], block_tables=dev[o_bt:end].view(seqs, w),
            num_seqs=b, num_decodes=seqs, query_lens=qlens + [rows] * (seqs - b),
            context_lens_host=ctx + [1] * (seqs - b), table_widths=widths + [1] * (seqs - b),
            row_starts=[p * rows for p in range(seqs)])


def _token_offsets(step: StepInput) -> tuple[np.ndarray, np.ndarray]:
    """Where each sequence's new tokens start in ``step.token_ids`` (plus the end), and
    those tokens as an int64 array."""
    offsets = np.zeros(len(step.num_new_tokens) + 1, dtype=np.int64)
    np.cumsum(step.num_new_tokens, out=offsets[1:])
    return offsets, np.asarray(step.token_ids, dtype=np.int64)
