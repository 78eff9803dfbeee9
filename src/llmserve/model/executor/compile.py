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
import time
import types
from abc import ABC, abstractmethod
from typing import Callable

import torch

from llmserve.model.attention.backend import AttentionBackend
from llmserve.model.executor.graph_store import GraphStore, model_signature, plain_attrs, savable_guards
from llmserve.model.executor.inductor_setup import (
    configure_inductor,
    record_vector_isas,
    saved_graphs_dir,
    saving_enabled,
)
from llmserve.model.executor.input_buffers import InputBuffers, StagedStep

logger = logging.getLogger(__name__)

# Batch 1 has a graph of its own (a size-1 dimension is specialised); 2, 3, 4, ... share
# one, warmed up at 2, 4, 8, ...
_MIN_BUCKET = 2


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


class _Graphs:
    """The callable a compiled step runs: its saved graphs by name (``graph_store.py``),
    chosen by the step's ``graph_name(args)``, and one in-process ``torch.compile`` for
    steps no saved graph covers (every step where graphs cannot be saved: a model with
    LoRA slots, or a torch whose AOT compiler refused this model)."""

    def __init__(self, step: "CompiledStep", jit: Callable) -> None:
        self.step, self.jit = step, jit
        self.saved: dict[str, Callable] = {}
        self.eager: set[str] = set()   # names whose saved graph refused a step

    def __call__(self, *args: object) -> tuple[torch.Tensor, torch.Tensor]:
        name = self.step.graph_name(args[:-1]) if self.saved or self.eager else ""
        fn = self.saved.get(name)
        if fn is None:
            if name in self.eager:   # never a compile on the request path
                return self.step._forward(*args)
            configure_inductor()   # this thread may compile
            return self.jit(*args)
        try:
            return fn(self.step, *args)
        except RuntimeError as exc:
            if not str(exc).startswith("GuardManager check failed"):
                raise
            # a step outside the shapes the saved graph was traced for (a kernel choice by
            # row count in the model's code): such steps run eagerly, never compile here
            logger.warning("a %s step did not fit its saved graph %r (%s); steps of that "
                           "graph run eagerly", self.step.what, name,
                           " ".join(str(exc).split())[:300])
            self.saved.pop(name, None)
            self.eager.add(name)
            return self.step._forward(*args)


class CompiledStep(ABC):
    """What both compiled steps share: the model, its KV caches and staging buffers, its
    graphs (saved on disk and loaded when they exist, ``graph_store.py``; traced in process
    otherwise), and the eager fallback after a compiler failure (``failed``)."""

    what = "model"   # the step's name in logs and in the saved graphs' names

    def __init__(self, model: torch.nn.Module, backend: AttentionBackend,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]], buffers: InputBuffers,
                 static_model: bool) -> None:
        configure_inductor()
        self.model = model
        self.backend = backend
        self.kv_caches = kv_caches
        self.buffers = buffers
        self.block_size = backend.block_size
        self.failed = False
        # the pool's size follows free memory, so it changes between starts: a graph with
        # it baked in would miss the on-disk caches on every restart
        for cache in kv_caches:
            for t in cache:
                torch._dynamo.maybe_mark_dynamic(t, 0)
        self._compiled = _Graphs(self, torch.compile(own_code(self._forward), fullgraph=True,
                                                     options=compile_options(static_model)))
        # graphs are saved only for a model whose modules never change after loading:
        # saved graphs keep no guards on modules
        self._store = GraphStore(saved_graphs_dir(), self.what, [
            type(backend).__qualname__, *plain_attrs(backend), model_signature(model)
        ]) if static_model and saving_enabled() else None

    @property
    def saves_graphs(self) -> bool:
        """Whether this step's graphs are saved on disk (and loaded on a restart)."""
        return self._store is not None

    @abstractmethod
    def graph_name(self, args: tuple) -> str:
        """Which saved graph runs a step with these inputs."""

    @abstractmethod
    def _forward(self, *args: object) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logits, normed rows)`` of the step's inputs, the KV caches last (traced)."""

    def _build(self, args: tuple, label: str, load_only: bool = False) -> bool:
        """Make the graph ``graph_name(args)`` ready: load it if it was saved, else compile
        it on ``args`` (a progress line before and after) and save it; then run it once.
        With ``load_only`` a graph that could be saved but was not is left alone (False:
        a background compile makes it)."""
        configure_inductor()
        name = self.graph_name(args)
        t0 = time.time()
        verb = "ready" if name in self._compiled.saved else "traced"
        if self._store is not None and name not in self._compiled.saved:
            path = self._store.path(name, (*args, self.kv_caches))
            with torch.inference_mode():   # the guards' dispatch keys are rebuilt under
                fn = self._store.load(path)  # the mode it runs in
            verb = "loaded"
            if fn is None and load_only:
                return False
            if fn is None:
                logger.info("compiling the %s step for %s (once per machine and model; "
                            "cached in %s)...", self.what, label, self._store.root)
                verb = "compiled"
                try:
                    aot = torch.compile(own_code(self._forward), fullgraph=True,
                                        options={"guard_filter_fn": savable_guards})
                    with torch.inference_mode():
                        fn = aot.aot_compile(((*args, self.kv_caches), {}))
                    self._store.save(path, fn)
                except Exception as exc:  # noqa: BLE001 - compile in process instead
                    logger.warning("the %s step's graphs cannot be saved (%s); they are "
                                   "compiled at every start", self.what, compiler_error(exc))
                    self._store, fn = None, None
            if fn is not None:
                self._compiled.saved[name] = fn
        with torch.inference_mode():
            self._run(args)
        record_vector_isas()
        logger.info("%s step: %s %s in %.1fs", self.what, label, verb, time.time() - t0)
        return True

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


class CompiledDecodeStep(CompiledStep):
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

    def graph_name(self, args: tuple) -> str:
        """``one``: a single sequence (its batch dimension specialised); ``many``: 2 or
        more (a dynamic batch)."""
        return "one" if args[3].shape[0] == 1 else "many"

    def __call__(self, staged: StagedStep) -> torch.Tensor:
        """Logits ``(B, vocab)`` for a staged decode-only step (rows in runner order)."""
        return self._run(self._args(staged))

    @staticmethod
    def _args(staged: StagedStep) -> tuple:
        args = (staged.input_ids, staged.positions, staged.slot_mapping, staged.block_tables,
                staged.context_lens)
        if staged.block_tables.shape[0] > 1:
            for t in args:
                torch._dynamo.mark_dynamic(t, 0)
        torch._dynamo.mark_dynamic(staged.block_tables, 1)
        return args

    def warmup(self, load_only: bool = False) -> bool:
        """Make both graphs ready (loaded, or compiled and saved), then run every bucket
        once on dummy rows (they touch only the scratch block). With ``load_only``,
        False as soon as a graph is not saved yet."""
        from llmserve.engine.step_types import StepInput

        t0 = time.time()
        # the batch-1 graph, then the dynamic batch built at the largest bucket: inductor
        # takes the size hint of its kernels' loops from the example, and large batches
        # are where the step's time goes
        order = self.buckets[:1] + self.buckets[:0:-1]
        for b in order:
            if self.failed:
                break
            step = StepInput()
            scratch = self.buffers.scratch_block
            for r in range(b):
                step.add(f"warmup{r}", [0], 0, [scratch], 0, None)
            args = self._args(self.buffers.stage(step, list(range(b)), self.block_size,
                                                 pad_to=b))
            if b in order[:2]:
                if not self._build(args, f"batch {b}" if b == 1 else f"batches 2-{b}",
                                   load_only):
                    return False
            else:
                with torch.inference_mode():
                    self._run(args)
        logger.info("decode step ready for batches 1-%d in %.1fs", self.buckets[-1],
                    time.time() - t0)
        return True
