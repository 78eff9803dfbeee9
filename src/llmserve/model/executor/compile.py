"""The compiled decode step: one ``torch.compile`` graph for every decode-only step.

A decode-only step (every sequence computes one token) runs embedding -> layers -> norm ->
LM head as a single inductor graph, so the ~25 ops of each of the model's layers cost no
Python or dispatcher time and the elementwise ones fuse. Shapes::

    batch   B  the step's sequences, 1 .. max_num_seqs (not padded)
    width   W  block-table width, a dynamic dimension (no recompilation as contexts grow)

Batch (from 2) and width are marked dynamic, so one graph serves every batch but batch 1,
which has its own; the warm-up runs the buckets 1, 2, 4, ... up to max_num_seqs once each.
Steps are not padded to a bucket: with a dynamic batch a padded row would only add its
cost to every linear (a 24-sequence step padded to 32 ran markedly longer). A model whose
modules never change after loading (no LoRA slots) is compiled without guards on its
modules: checking the guards of 30 layers' parameters was a sizeable share of a batch-1
step (docs/BENCHMARKS.md). Inductor's caches live under ``~/.cache/llmserve/inductor``
(override with ``LLMSERVE_COMPILE_CACHE``), so a restart reuses the compiled code. If
compilation fails, the step falls back to eager with a warning.
"""
from __future__ import annotations

import itertools
import logging
import os
import time
import types
from typing import Optional

import torch

from llmserve.model.attention.backend import AttentionBackend
from llmserve.model.executor.input_buffers import InputBuffers, StagedStep
from llmserve.model.platform import env_flag

logger = logging.getLogger(__name__)

# Batch 1 has a graph of its own (a size-1 dimension is specialised); 2, 3, 4, ... share
# one, warmed up at 2, 4, 8, ...
_MIN_BUCKET = 2


def compile_cache_dir() -> str:
    return os.environ.get("LLMSERVE_COMPILE_CACHE",
                          os.path.join(os.path.expanduser("~"), ".cache", "llmserve", "inductor"))


def _configure_inductor() -> None:
    """Caches on disk, and compiled code that rounds like eager code.

    ``emulate_precision_casts``: inductor keeps a fused chain of bf16 element-wise ops in
    float32 and rounds once at the store, where eager PyTorch rounds to bf16 after every op.
    A sequence's rows run eagerly in some steps (prefill chunks, mixed steps) and compiled
    in others (decode-only steps, batch 1 on a graph of its own), so without the emulation
    its tokens depended on what shared its steps (issue 34: 2 of 4 greedy chats changed
    inside a batch of 22). With it, compiled and eager steps give a row the same logits;
    ``LLMSERVE_FAST_ROUNDING=1`` turns it off (docs/BENCHMARKS.md has the cost).
    """
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", compile_cache_dir())
    import torch._inductor.config as inductor_config

    inductor_config.fx_graph_cache = True
    inductor_config.emulate_precision_casts = not env_flag("LLMSERVE_FAST_ROUNDING")
    try:
        import torch._functorch.config as functorch_config

        functorch_config.enable_autograd_cache = True
    except (ImportError, AttributeError):
        pass


def graph_logits(model: torch.nn.Module,
                 hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logits, normed rows)`` for a compiled graph. The normed rows are an output only so
    that inductor stores them once: otherwise it inlines the final norm (and the residual
    add before it) into the LM head's reduction and recomputes it for every vocabulary row,
    which made the default model's batch-1 LM head about twice as slow (docs/BENCHMARKS.md)."""
    normed = model.norm(hidden)
    return model.logits_of_normed(normed), normed


_instances = itertools.count()


def own_code(method):
    """``method`` (bound) as a function with a code object of its own: dynamo keeps compiled
    graphs per code object, so another instance (another model in the same process) can
    never run this one's graphs, even with the module guards skipped."""
    func = method.__func__
    code = func.__code__.replace(co_name=f"{func.__name__}_{next(_instances)}")
    clone = types.FunctionType(code, func.__globals__, code.co_name, func.__defaults__,
                               func.__closure__)
    return types.MethodType(clone, method.__self__)


def compile_options(static_model: bool) -> dict:
    """torch.compile options: skip the guards on the model's modules when nothing in them
    changes after loading (their tensors are still read afresh at every call).

    Inductor's C++ wrapper (``cpp_wrapper``) was measured too: no gain beyond the noise at
    batch 1, 8 or 32 on the default model, for twice the first compile time."""
    if static_model:
        return {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
    return {}


def batch_buckets(max_num_seqs: int) -> list[int]:
    """1, then powers of two from 2 up to the first one >= max_num_seqs."""
    if max_num_seqs <= 1:
        return [1]
    out = [1, _MIN_BUCKET]
    while out[-1] < max_num_seqs:
        out.append(out[-1] * 2)
    return out


class _CompiledStep:
    """What both compiled steps share: the model, its KV caches and staging buffers, one
    ``torch.compile`` of the subclass's ``_forward`` (a code object of its own), and the
    eager fallback after a compiler failure (``failed``)."""

    what = "model"   # the step's name in the fallback warning

    def __init__(self, model: torch.nn.Module, backend: AttentionBackend,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]], buffers: InputBuffers,
                 static_model: bool) -> None:
        _configure_inductor()
        self.model = model
        self.backend = backend
        self.kv_caches = kv_caches
        self.buffers = buffers
        self.block_size = backend.block_size
        self.failed = False
        self._compiled = torch.compile(own_code(self._forward), fullgraph=True,
                                       options=compile_options(static_model))

    def _run(self, args: tuple) -> torch.Tensor:
        """The logits of the compiled graph on ``args``; on a compiler failure, a warning
        and the eager forward from then on."""
        try:
            return self._compiled(*args, self.kv_caches)[0]
        except Exception as exc:  # noqa: BLE001 - any compiler failure: keep serving, eagerly
            if self.failed:
                raise
            self.failed = True
            logger.warning("compiling the %s step failed (%s); running eagerly", self.what,
                           compiler_error(exc))
            return self._forward(*args, self.kv_caches)[0]


def compiler_error(exc: BaseException) -> str:
    """``Type: first line`` of a compiler exception (their messages run to pages)."""
    text = str(exc)
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


class CompiledDecodeStep(_CompiledStep):
    """Runs decode-only steps through one compiled graph (eager fallback on failure)."""

    what = "decode"

    def __init__(self, model: torch.nn.Module, backend: AttentionBackend,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]], buffers: InputBuffers,
                 max_num_seqs: int, static_model: bool = False) -> None:
        super().__init__(model, backend, kv_caches, buffers, static_model)
        self.buckets = [b for b in batch_buckets(max_num_seqs) if b <= buffers.max_seqs] or \
            [buffers.max_seqs]

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        meta = self.backend.decode_metadata(slot_mapping, block_tables, context_lens)
        hidden = self.model(input_ids, positions, kv_caches, meta)
        return graph_logits(self.model, hidden)

    def accepts(self, num_seqs: int) -> bool:
        """Whether a decode step of ``num_seqs`` sequences runs in the graph: the batch is
        dynamic (it runs with exactly its rows), up to the largest warmed-up bucket."""
        return not self.failed and 1 <= num_seqs <= self.buckets[-1]

    def __call__(self, staged: StagedStep) -> torch.Tensor:
        """Logits ``(B, vocab)`` for a staged decode-only step (rows in runner order)."""
        args = (staged.input_ids, staged.positions, staged.slot_mapping, staged.block_tables,
                staged.context_lens)
        if staged.block_tables.shape[0] > 1:
            for t in args:
                torch._dynamo.mark_dynamic(t, 0)
        torch._dynamo.mark_dynamic(staged.block_tables, 1)
        return self._run(args)

    def warmup(self) -> None:
        """Run every bucket once on dummy rows (they touch only the scratch block)."""
        from llmserve.engine.step_types import StepInput

        t0 = time.time()
        # batch 1 has a graph of its own; the others share one graph with a dynamic batch,
        # built first at the largest bucket: inductor takes the size hint of its kernels'
        # loops from the first call, and large batches are where the step's time goes
        order = self.buckets[:1] + self.buckets[:0:-1]
        for i, b in enumerate(order):
            if self.failed:
                break
            step = StepInput()
            scratch = self.buffers.scratch_block
            for r in range(b):
                step.add(f"warmup{r}", [0], 0, [scratch], 0, None)
            staged = self.buffers.stage(step, list(range(b)), self.block_size, pad_to=b)
            t = time.time()
            with torch.inference_mode():
                self(staged)
            logger.info("compiled decode step: bucket %d/%d (batch %d) in %.1fs",
                        i + 1, len(self.buckets), b, time.time() - t)
        logger.info("decode step compiled for batches %s in %.1fs", self.buckets, time.time() - t0)


#: Most padding rows a compiled verify step may add: one padding row costs a fraction of
#: what the compiled graph saves per step (measured in the int4 linears at the default
#: model: docs/BENCHMARKS.md), so a few rows pay off, and a batch of sequences without
#: drafts padded to the longest draft would cost far more than it saves.
VERIFY_MAX_PADDING_ROWS = 3


class CompiledVerifyStep(_CompiledStep):
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

    def __call__(self, staged: StagedStep, rows: int) -> torch.Tensor:
        """Logits ``(B * Q, vocab)`` of a staged verify step (sequence-major rows)."""
        seqs = staged.block_tables.shape[0]
        args = (staged.input_ids.view(seqs, rows), staged.positions.view(seqs, rows),
                staged.slot_mapping.view(seqs, rows), staged.block_tables)
        for t in args:
            torch._dynamo.maybe_mark_dynamic(t, 0)
            torch._dynamo.maybe_mark_dynamic(t, 1)
        return self._run(args)

    def warmup(self) -> None:
        """Build the graphs: one sequence and several, the fewest and the most rows (a
        kernel chosen by the number of rows makes one graph per range), on dummy rows in
        the scratch block."""
        from llmserve.engine.step_types import StepInput

        t0 = time.time()
        scratch = self.buffers.scratch_block
        for seqs, rows in sorted({(b, r) for b in (1, min(2, self.max_seqs), self.max_seqs)
                                  for r in (2, self.max_rows)}):
            if self.failed:
                break
            step = StepInput()
            for r in range(seqs):
                step.add(f"warmup{r}", [0] * rows, 0, [scratch], 0, None)
            staged = self.buffers.stage_uniform(step, list(range(seqs)), self.block_size,
                                                rows, seqs)
            with torch.inference_mode():
                self(staged, rows)
        logger.info("verify step compiled in %.1fs", time.time() - t0)
