"""Compiled element-wise work for the many-row eager steps (prefill chunks).

A compiled decode graph fuses each layer's element-wise work into a few loops. Eager steps
(prefill chunks, mixed batches) run PyTorch's kernels one op at a time instead: the rotary
embedding alone is a float copy, four products, a subtraction, an addition, a concatenation
and a cast per tensor, several times slower at 2048 rows than the compiled function
(docs/BENCHMARKS.md). Modules with a ``compile_rows(dtype, device)`` method (RMSNorm,
RotaryEmbedding, GatedMLP) get such a function compiled once with dynamic shapes (one graph
for every row count, built on a dummy input at start-up) and call it for calls of at least :data:`COMPILED_ROWS_MIN` rows outside
a compiled graph. Engines that compile their decode step only (``--enforce-eager``, tensor
parallel and models the compiler cannot take keep every op eager); where compiling fails,
at start-up or on a later call, the module logs it and runs the plain function.
"""
from __future__ import annotations

import logging
import threading
from typing import Callable, Optional

import torch
from torch import nn

from llmserve.model.executor.compile import compiler_error
from llmserve.model.executor.graph_store import GraphStore, savable_guards
from llmserve.model.executor.inductor_setup import configure_inductor, saved_graphs_dir, saving_enabled

logger = logging.getLogger(__name__)

#: Eager calls with at least this many rows take a module's compiled function.
COMPILED_ROWS_MIN = 64
#: Rows of the dummy inputs that build the graphs (not a size the model's shapes use).
WARMUP_ROWS = COMPILED_ROWS_MIN + 1

_compiled: "dict[tuple[Callable, str], _Guarded]" = {}


def many_rows(rows: int) -> bool:
    """An eager call with enough rows for the compiled functions (never inside a graph that
    is being compiled: that one inlines the plain code). ``is_compiling`` is asked first: a
    row count compared while a dynamic-batch graph is traced would become a guard on it."""
    return not torch.compiler.is_compiling() and rows >= COMPILED_ROWS_MIN


class _Guarded:
    """A compiled function that falls back to the plain one, for good, if a call fails
    (a recompilation at serve time that the compiler cannot do)."""

    def __init__(self, compiled: Callable, plain: Callable) -> None:
        self.compiled, self.plain, self.failed = compiled, plain, False

    def __call__(self, *args: object) -> object:
        if not self.failed:
            try:
                return self.compiled(*args)
            except Exception as exc:  # noqa: BLE001 - any compiler failure: stay eager
                self.failed = True
                logger.warning("compiled %s failed (%s); it runs eagerly from now on",
                               getattr(self.plain, "__name__", self.plain), str(exc)[:3000])
        return self.plain(*args)


def _static_args(args: tuple) -> str:
    """What a graph of ``fn`` specialises on besides shapes: its non-tensor arguments and
    the tensors' dtypes and devices."""
    return ";".join(f"{a.dtype}/{a.device.type}" if isinstance(a, torch.Tensor) else repr(a)
                    for a in args)


class _LoadOnlyState(threading.local):
    """While ``on`` (in this thread: engines of one process warm up on their own
    threads), compile_rows takes only graphs saved on disk (a background compile makes
    the others) and counts the ones it did not find."""

    on = False
    missing = 0


_LoadOnly = _LoadOnlyState()


def _saved_or_traced(fn: Callable, warm_args: tuple) -> Optional[Callable]:
    """``fn`` compiled with dynamic shapes: the graph saved on disk for these arguments
    (executor/graph_store.py) when there is one, else compiled now and saved (None in
    load-only mode); where graphs cannot be saved, ``torch.compile(fn, dynamic=True)``."""
    configure_inductor()
    if saving_enabled():
        store = GraphStore(saved_graphs_dir(), "rows")
        path = store.path(f"{fn.__module__}.{fn.__qualname__}", warm_args)
        with torch.inference_mode():
            loaded = store.load(path)
            if loaded is not None:
                return loaded
            if _LoadOnly.on:
                _LoadOnly.missing += 1
                return None
            try:
                aot = torch.compile(fn, dynamic=True, fullgraph=True,
                                    options={"guard_filter_fn": savable_guards})
                # a float argument (a norm's epsilon) is a constant of the graph: the AOT
                # compiler cannot turn it into a tensor input as in-process graphs do
                with torch._dynamo.config.patch(specialize_float=True):
                    compiled = aot.aot_compile((warm_args, {}))
            except Exception as exc:  # noqa: BLE001 - compile it in process instead
                logger.info("%s cannot be saved compiled (%s)", fn.__qualname__,
                            compiler_error(exc))
            else:
                store.save(path, compiled)
                return compiled
    return torch.compile(fn, dynamic=True)


def compile_rows(fn: Callable, *warm_args: object) -> Optional[Callable]:
    """``fn`` compiled with dynamic shapes (one graph for every row count), run now on
    ``warm_args`` (sizes of 0 or 1 and sizes equal to another one would be specialised, so
    dummies use distinct sizes >= 2); shared by every module of the process that asks for
    ``fn`` with the same non-tensor arguments and dtypes. None (logged) when compiling
    fails."""
    # torch's thread count is a guard of every graph: engines of one process may differ
    key = (fn, f"{_static_args(warm_args)};threads={torch.get_num_threads()}")
    compiled = _compiled.get(key)
    try:
        if compiled is None:
            found = _saved_or_traced(fn, warm_args)
            if found is None:
                return None
            compiled = _Guarded(found, fn)
        with torch.inference_mode():
            compiled.compiled(*warm_args)
    except Exception as exc:  # noqa: BLE001 - any compiler failure: stay eager
        logger.warning("compiling %s for many-row steps failed (%s); it stays eager",
                       getattr(fn, "__name__", fn), compiler_error(exc))
        return None
    _compiled[key] = compiled
    return compiled


def enable_compiled_rows(model: nn.Module, dtype: torch.dtype, device: torch.device,
                         load_only: bool = False) -> tuple[int, int]:
    """Give every module of ``model`` that has ``compile_rows`` its compiled many-row
    function; returns how many modules got one and how many graphs were missing (always 0
    unless ``load_only``: take saved graphs only, compile nothing). The dummy inputs are
    made in inference mode, as a step's tensors are: a view made outside it keeps its
    base, and a graph traced on one guards on that base."""
    _LoadOnly.on, _LoadOnly.missing = load_only, 0
    try:
        with torch.inference_mode():
            got = sum(bool(m.compile_rows(dtype, device)) for m in model.modules()
                      if hasattr(m, "compile_rows"))
        return got, _LoadOnly.missing
    finally:
        _LoadOnly.on = False
