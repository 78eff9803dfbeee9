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
from typing import Callable, Optional

import torch
from torch import nn

from llmserve.model.executor.compile import compiler_error

logger = logging.getLogger(__name__)

#: Eager calls with at least this many rows take a module's compiled function.
COMPILED_ROWS_MIN = 64
#: Rows of the dummy inputs that build the graphs (not a size the model's shapes use).
WARMUP_ROWS = COMPILED_ROWS_MIN + 1

_compiled: "dict[Callable, Callable]" = {}


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
                               getattr(self.plain, "__name__", self.plain), compiler_error(exc))
        return self.plain(*args)


def compile_rows(fn: Callable, *warm_args: object) -> Optional[Callable]:
    """``torch.compile(fn, dynamic=True)``, run now on ``warm_args`` (one call per distinct
    set of non-tensor arguments builds its graph; sizes of 0 or 1 and sizes equal to another
    one would be specialised, so dummies use distinct sizes >= 2); the compiled function is
    shared by every module of the process that asks for ``fn``. None (logged) when compiling
    fails."""
    compiled = _compiled.get(fn) or _Guarded(torch.compile(fn, dynamic=True), fn)
    try:
        with torch.inference_mode():
            compiled.compiled(*warm_args)
    except Exception as exc:  # noqa: BLE001 - any compiler failure: stay eager
        logger.warning("compiling %s for many-row steps failed (%s); it stays eager",
                       getattr(fn, "__name__", fn), compiler_error(exc))
        return None
    _compiled[fn] = compiled
    return compiled


def enable_compiled_rows(model: nn.Module, dtype: torch.dtype, device: torch.device) -> int:
    """Give every module of ``model`` that has ``compile_rows`` its compiled many-row
    function; returns how many modules got one."""
    return sum(bool(m.compile_rows(dtype, device)) for m in model.modules()
               if hasattr(m, "compile_rows"))
