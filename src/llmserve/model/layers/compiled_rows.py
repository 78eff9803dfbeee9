"""Compiled element-wise work for the many-row eager steps (prefill chunks).

A compiled decode graph fuses each layer's element-wise work into a few loops. Eager steps
(prefill chunks, mixed batches) run PyTorch's kernels one op at a time instead: the rotary
embedding alone is a float copy, four products, a subtraction, an addition, a concatenation
and a cast per tensor, 1.8 ms per layer at 2048 rows against 0.3 ms compiled. Modules with a
``compile_rows(dtype, device)`` method (RMSNorm, RotaryEmbedding, GatedMLP) get such a
function compiled once with dynamic shapes (one graph for every row count, built on a dummy
input at start-up) and call it for calls of at least :data:`COMPILED_ROWS_MIN` rows outside
a compiled graph. Compiling engines only (``--enforce-eager`` keeps every op eager); where
compiling fails the module logs it and stays eager.
"""
from __future__ import annotations

import logging
from typing import Callable, Optional

import torch
from torch import nn

logger = logging.getLogger(__name__)

#: Eager calls with at least this many rows take a module's compiled function.
COMPILED_ROWS_MIN = 64

_compiled: "dict[Callable, Callable]" = {}


def many_rows(rows: int) -> bool:
    """An eager call with enough rows for the compiled functions (never inside a graph that
    is being compiled: that one inlines the plain code)."""
    return rows >= COMPILED_ROWS_MIN and not torch.compiler.is_compiling()


def compile_rows(fn: Callable, *warm_args: object) -> Optional[Callable]:
    """``torch.compile(fn, dynamic=True)``, run now on ``warm_args`` (one call per distinct
    set of non-tensor arguments builds its graph); the compiled function is shared by every
    module of the process that asks for ``fn``. None (logged) when compiling fails."""
    compiled = _compiled.get(fn) or torch.compile(fn, dynamic=True)
    try:
        with torch.inference_mode():
            compiled(*warm_args)
    except Exception as exc:  # noqa: BLE001 - any compiler failure: stay eager
        logger.warning("compiling %s for many-row steps failed (%s: %s); it stays eager",
                       getattr(fn, "__name__", fn), type(exc).__name__,
                       str(exc).splitlines()[0] if str(exc) else "")
        return None
    _compiled[fn] = compiled
    return compiled


def enable_compiled_rows(model: nn.Module, dtype: torch.dtype, device: torch.device) -> int:
    """Give every module of ``model`` that has ``compile_rows`` its compiled many-row
    function; returns how many modules got one."""
    return sum(bool(m.compile_rows(dtype, device)) for m in model.modules()
               if hasattr(m, "compile_rows"))
