"""The compiled verify step: every sequence decodes with its speculative drafts.

One graph (two: one sequence, several) runs ``k + 1`` rows per sequence, attention
included, so verifying drafts costs no Python per layer; it shares the saved-graph and
fallback machinery of the decode step (compile.py).
"""
from __future__ import annotations

import logging
import time
from typing import Optional

import torch

from llmserve.model.attention.backend import AttentionBackend
from llmserve.model.executor.compile import CompiledStep, graph_logits
from llmserve.model.executor.input_buffers import InputBuffers, StagedStep

logger = logging.getLogger(__name__)


#: Most padding rows a compiled verify step may add: one padding row costs a fraction of
#: what the compiled graph saves per step (measured in the int4 linears at the default
#: model: docs/BENCHMARKS.md), so a few rows pay off, and a batch of sequences without
#: drafts padded to the longest draft would cost far more than it saves.
VERIFY_MAX_PADDING_ROWS = 3


class CompiledVerifyStep(CompiledStep):
    """Runs steps where every sequence decodes with its speculative drafts (``k + 1`` rows,
    all sampled) as one compiled graph, attention included.

    Shapes: ``B`` sequences (not padded: a padded sequence would cost its rows in every
    linear), ``Q`` rows each (the most of any sequence; shorter ones padded, see
    ``InputBuffers.stage_uniform``). Both dimensions are dynamic; ``B = 1`` and a kernel
    choice by the number of rows make a few graphs, all built by ``warmup``. Returns the
    logits of all ``B * Q`` rows.
    """

    what = "verify"

    def __init__(self, model: torch.nn.Module, backend: AttentionBackend,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]], buffers: InputBuffers,
                 max_num_seqs: int, max_drafts: int, static_model: bool = False) -> None:
        super().__init__(model, backend, kv_caches, buffers, static_model)
        self.max_rows = max_drafts + 1
        self.max_seqs = max(1, min(max_num_seqs, buffers.max_seqs,
                                   buffers.max_tokens // self.max_rows))

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        meta = self.backend.verify_metadata(slot_mapping.reshape(-1), block_tables, positions)
        hidden = self.model(input_ids.reshape(-1), positions.reshape(-1), kv_caches, meta)
        return graph_logits(self.model, hidden)

    def shape_for(self, num_seqs: int, max_rows: int,
                  num_tokens: int) -> Optional[tuple[int, int]]:
        """(sequences, rows per sequence) of a step of ``num_tokens`` tokens, or None when
        it does not fit or padding it would cost more rows than the graph saves."""
        if self.failed or max_rows > self.max_rows or num_seqs > self.max_seqs:
            return None
        if num_seqs * max_rows - num_tokens > VERIFY_MAX_PADDING_ROWS:
            return None
        return num_seqs, max_rows

    def graph_name(self, args: tuple) -> str:
        """``one``: a single sequence; ``many``: 2 or more (rows dynamic in both)."""
        return "one" if args[3].shape[0] == 1 else "many"

    def __call__(self, staged: StagedStep, rows: int) -> torch.Tensor:
        """Logits ``(B * Q, vocab)`` of a staged verify step (sequence-major rows)."""
        return self._run(self._args(staged, rows))

    @staticmethod
    def _args(staged: StagedStep, rows: int) -> tuple:
        seqs = staged.block_tables.shape[0]
        args = (staged.input_ids.view(seqs, rows), staged.positions.view(seqs, rows),
                staged.slot_mapping.view(seqs, rows), staged.block_tables)
        for t in args:
            torch._dynamo.maybe_mark_dynamic(t, 0)
            torch._dynamo.maybe_mark_dynamic(t, 1)
        return args

    def warmup(self, load_only: bool = False) -> bool:
        """Make the graphs ready (one sequence and several, built at the most rows), then
        run one step of each shape corner (fewest and most rows) on dummy rows in the
        scratch block. With ``load_only``, False as soon as a graph is not saved yet."""
        from llmserve.engine.step_types import StepInput

        t0 = time.time()
        scratch = self.buffers.scratch_block
        built: set[str] = set()
        for seqs, rows in sorted({(b, r) for b in (1, min(2, self.max_seqs), self.max_seqs)
                                  for r in (self.max_rows, 2)}, key=lambda sr: (-sr[1], -sr[0])):
            if self.failed:
                break
            step = StepInput()
            for r in range(seqs):
                step.add(f"warmup{r}", [0] * rows, 0, [scratch], 0, None)
            args = self._args(self.buffers.stage_uniform(step, list(range(seqs)),
                                                         self.block_size, rows, seqs), rows)
            name = self.graph_name(args)
            if name not in built:
                built.add(name)
                if not self._build(args, f"{seqs} sequence{'s' if seqs > 1 else ''} x "
                                   f"{rows} rows", load_only):
                    return False
            else:
                with torch.inference_mode():
                    self._run(args)
        logger.info("verify step ready in %.1fs", time.time() - t0)
        return True
