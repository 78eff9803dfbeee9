"""Compiled step graphs saved on disk and loaded without tracing them again.

``torch.compile`` caches inductor's output on disk, but a restart still traces the model
with dynamo before it can find that output: about 5 s per graph for the default model's 30
layers, most of a warm start. torch's AOT-compile API (``aot_compile`` /
``load_compiled_function``) saves the traced graph, its guards and the compiled code in
one file, and loading it skips the tracing (about 1 s).

A file is named by a digest of everything the graph depends on: torch and Python, the CPU
(inductor generates code for its instruction set) and torch's thread count (a guard of
every graph), llmserve's model-layer source (the graph inlines it), the model's structure
(every module's type and plain attributes, every tensor's shape, dtype and strides: not its
values, which are read at every call), the step's inputs and inductor's rounding setting. Anything else (a stale or unreadable file, a torch that
cannot load it) is a miss: the graph is compiled again and the file rewritten.

Only the guards that can be saved are kept with a graph: the shape relations dynamo derived
for its inputs (dynamic sizes and their bounds) and torch's global state (grad mode, thread
count). Guards on the model's modules are dropped, as they are for the in-process graphs of
a model that never changes after loading (compile.py), and so are the per-tensor dtype and
stride checks (their dispatch keys and dynamic-dimension markings do not survive a save):
the inputs come from the runner's own staging buffers and KV pool, whose dtypes and fixed
sizes are part of the file's name, and the step picks the graph by batch size itself.
"""
from __future__ import annotations

import functools
import hashlib
import inspect
import logging
import os
import sys
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

import torch
from torch import nn

from llmserve.model.platform import cpu_flags

logger = logging.getLogger(__name__)

_PACKAGE_ROOT = Path(__file__).resolve().parents[2]   # src/llmserve
_PLAIN = (bool, int, float, str, type(None))


#: The packages a step's graph traces (the model layer, and LoRA's wrappers of it)
_TRACED_PACKAGES = ("model", "lora")


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """sha256 of the Python and C++ sources a step's graph is made of (it inlines the
    model layer's Python and calls kernels built from its C++); a change anywhere else
    (the engine core, the server) keeps the saved graphs."""
    h = hashlib.sha256()
    paths = [p for pkg in _TRACED_PACKAGES for p in (_PACKAGE_ROOT / pkg).rglob("*")]
    for path in sorted(paths):
        if path.suffix in (".py", ".cpp", ".h") and "__pycache__" not in path.parts:
            h.update(str(path.relative_to(_PACKAGE_ROOT)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def plain_attrs(obj: object) -> list[str]:
    """``name=repr`` of an object's plain attributes (numbers, strings, flags): constants a
    traced graph bakes in, such as a norm's epsilon or a quantized layer's group size."""
    try:
        items = sorted(vars(obj).items())
    except TypeError:
        return [type(obj).__qualname__]
    out = []
    for key, value in items:
        if isinstance(value, _PLAIN) or _plain_container(value):
            out.append(f"{key}={value!r}")
        elif isinstance(value, torch.Tensor):
            out.append(f"{key}={tensor_signature(value)}")
        elif not isinstance(value, (nn.Module, dict, list, tuple)) and not callable(value):
            out.append(f"{key}:{type(value).__qualname__}")
    return out


def held_signature(value: object) -> list[str]:
    """What a graph bakes in of an object a module holds: an operator or a function by its
    name (their attributes include caches that fill up as they are traced, so describing
    them by ``vars`` named a graph differently before and after a model first ran);
    anything else by :func:`plain_attrs`."""
    if isinstance(value, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return [f"op={value}"]
    if inspect.isfunction(value) or inspect.isbuiltin(value):
        return [f"fn={value.__module__}.{value.__qualname__}"]
    return plain_attrs(value)


def _plain_container(value: object) -> bool:
    """A tuple, list or dict of plain values (a fused projection's split sizes, a rope
    scaling config)."""
    if isinstance(value, dict):
        return all(isinstance(k, str) and (isinstance(v, _PLAIN) or _plain_container(v))
                   for k, v in value.items())
    return isinstance(value, (tuple, list)) and all(
        isinstance(v, _PLAIN) or _plain_container(v) for v in value)


def tensor_signature(t: torch.Tensor) -> str:
    """Shape, strides, dtype and device of ``t`` (not its values)."""
    return f"{tuple(t.shape)}/{t.stride()}/{t.dtype}/{t.device.type}"


def model_signature(model: nn.Module) -> str:
    """The model's structure as a traced graph sees it: each module's class and plain
    attributes, the objects it holds (a linear layer's method) one level down, and the
    signature of each of its tensors."""
    lines = []
    for name, module in model.named_modules():
        cls = type(module)
        lines.append(f"{name}:{cls.__module__}.{cls.__qualname__}:{plain_attrs(module)}")
        for key, value in sorted(vars(module).items()):
            if not key.startswith("_") and not isinstance(value, (nn.Module, torch.Tensor,
                                                                  *_PLAIN)):
                lines.append(f"  {key}:{type(value).__qualname__}:{held_signature(value)}")
        for key, t in [*module.named_parameters(recurse=False),
                       *module.named_buffers(recurse=False)]:
            lines.append(f"  {key}={tensor_signature(t)}")
    return "\n".join(lines)


def inputs_signature(args: Iterable[object]) -> str:
    """The example inputs of a graph: tensors by signature (their dynamic dimensions as
    ``*``), KV caches by the signature of their first pair and their count."""
    parts = []
    for a in args:
        if isinstance(a, torch.Tensor):
            dyn = getattr(a, "_dynamo_dynamic_indices", set())
            shape = tuple("*" if i in dyn else n for i, n in enumerate(a.shape))
            parts.append(f"{shape}/{a.dtype}/{a.device.type}/{sorted(dyn)}")
        elif isinstance(a, list) and a and isinstance(a[0], tuple):
            first = a[0][0]
            parts.append(f"kv{len(a)}x{len(a[0])}:{tuple(first.shape[1:])}/{first.dtype}")
        else:
            parts.append(repr(a))
    return ";".join(parts)


def savable_guards(entries: Sequence[object]) -> list[bool]:
    """The guard filter of saved graphs: keep the shape relations of the step's inputs
    and torch's global state; drop the guards on globals, on the step object (its model
    and attention backend: fixed when it is built, and part of the file's name instead),
    the per-tensor checks (see the module's docstring) and the kinds the AOT format
    cannot store."""
    from torch._dynamo.guards import CheckFunctionManager

    unsupported = set(CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES)
    return [not (e.is_global or e.guard_type in unsupported  # type: ignore[attr-defined]
                 or e.guard_type == "TENSOR_MATCH"  # type: ignore[attr-defined]
                 or "self" in e.name)  # type: ignore[attr-defined]
            for e in entries]


class GraphStore:
    """A directory of saved graphs (under the inductor cache). ``step`` prefixes the files'
    names; ``context`` is what else the graphs bake in (for a model's step: its
    :func:`model_signature` and the attention backend's settings)."""

    def __init__(self, root: Path, step: str, context: Sequence[str] = ()) -> None:
        import torch._inductor.config as inductor_config

        self.root = root
        self.step = step
        self._base = "\n".join([
            torch.__version__, sys.version, " ".join(sorted(cpu_flags())), source_digest(),
            step, f"emulate_precision_casts={inductor_config.emulate_precision_casts}",
            f"threads={torch.get_num_threads()}",   # a guard of every graph
            *context])

    def path(self, name: str, args: Sequence[object]) -> Path:
        """The file of graph ``name`` compiled for inputs like ``args``."""
        key = hashlib.sha256(f"{self._base}\n{name}\n{inputs_signature(args)}".encode())
        return self.root / f"{self.step}-{name}-{key.hexdigest()[:24]}.bin"

    def load(self, path: Path) -> Optional[Callable]:
        """The graph saved at ``path``, or None (missing, stale or unreadable: logged)."""
        if not path.exists():
            logger.debug("no saved graph %s", path.name)
            return None
        try:
            with open(path, "rb") as f:
                return torch.compiler.load_compiled_function(f)
        except Exception as exc:  # noqa: BLE001 - any load failure: compile it again
            logger.warning("saved graph %s could not be loaded (%s: %s); compiling it again",
                           path.name, type(exc).__name__, str(exc).splitlines()[0][:200])
            return None

    def save(self, path: Path, fn: object) -> None:
        """Write ``fn`` (an AOT-compiled function) to ``path``; a failure only logs."""
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fn.save_compiled_function(str(path))  # type: ignore[attr-defined]
        except Exception as exc:  # noqa: BLE001 - the graph still runs; only the file is lost
            logger.warning("could not save the compiled graph %s (%s: %s)", path.name,
                           type(exc).__name__, str(exc).splitlines()[0][:200])
            try:
                os.unlink(path)
            except OSError:
                pass
