"""How llmserve sets up torch's compiler: caches on disk, eager-like rounding, the vector
ISAs it may trust, and where saved graphs live.

torch keeps a compiler setting that code assigns (rather than reads from the environment)
per thread, so every thread that compiles or names a saved graph calls
:func:`configure_inductor` first.
"""
from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import threading
from pathlib import Path
from typing import Optional

import torch

from llmserve.model.platform import cpu_flags, env_flag

logger = logging.getLogger(__name__)


def compile_cache_dir() -> str:
    return os.environ.get("LLMSERVE_COMPILE_CACHE",
                          os.path.join(os.path.expanduser("~"), ".cache", "llmserve", "inductor"))


_configured = threading.local()


def configure_inductor() -> None:
    """Caches on disk, and compiled code that rounds like eager code, in the calling
    thread: torch keeps a config value that is set (not read from the environment) per
    thread, so every thread that compiles, or names a saved graph, calls this first (a
    graph compiled on the engine thread without it rounded differently).

    ``emulate_precision_casts``: inductor keeps a fused chain of bf16 element-wise ops in
    float32 and rounds once at the store, where eager PyTorch rounds to bf16 after every op.
    A sequence's rows run eagerly in some steps (prefill chunks, mixed steps) and compiled
    in others (decode-only steps, batch 1 on a graph of its own), so without the emulation
    its tokens depended on what shared its steps (issue 34: 2 of 4 greedy chats changed
    inside a batch of 22). With it, compiled and eager steps give a row the same logits;
    ``LLMSERVE_FAST_ROUNDING=1`` turns it off (docs/BENCHMARKS.md has the cost).
    """
    if getattr(_configured, "done", False):
        return
    _configured.done = True
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", compile_cache_dir())
    import torch._inductor.config as inductor_config

    inductor_config.fx_graph_cache = True
    inductor_config.emulate_precision_casts = not env_flag("LLMSERVE_FAST_ROUNDING")
    # the generated wrapper checked the size and stride of every input and custom-op output
    # at every call (~600 checks, ~0.2 ms of a 4 ms batch-1 step); the saved graphs' guards
    # and the ops' own operand checks already cover what reaches the kernels
    inductor_config.size_asserts = False
    try:
        import torch._functorch.config as functorch_config

        functorch_config.enable_autograd_cache = True
    except (ImportError, AttributeError):
        pass
    _trust_probed_vector_isas()


def _vector_isa_record() -> Optional[Path]:
    """The file that says inductor's vector-ISA probes all passed on this machine, named by
    the CPU's flags, the compiler and the torch build (None off x86 or where inductor's
    internals moved)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        compiler = shutil.which(get_cpp_compiler()) or get_cpp_compiler()
        key = hashlib.sha256("\n".join([
            torch.__version__, compiler, str(os.stat(compiler).st_mtime_ns),
            " ".join(sorted(cpu_flags()))]).encode()).hexdigest()[:16]
    except Exception as exc:  # noqa: BLE001 - no record: inductor keeps probing
        logger.debug("no vector ISA record: %s", exc)
        return None
    return Path(compile_cache_dir()) / f"llmserve-vec-isa-{key}.ok"


def _trust_probed_vector_isas() -> None:
    """Skip inductor's vector-ISA probes once they all passed on this machine.

    Before its first C++ kernel (compiled or loaded), inductor compiles a probe for each
    vector instruction set the CPU lists (AVX2, AVX-512, AMX, ...) and loads it in a child
    Python: about a second of every start, ten on a fresh machine. When a record says they
    all passed before (:func:`record_vector_isas`), ``cpp.vec_isa_ok`` trusts the CPU's
    flags instead.
    """
    import torch._inductor.config as inductor_config

    record = _vector_isa_record() if inductor_config.cpp.vec_isa_ok is None else None
    if record is not None and record.exists():
        inductor_config.cpp.vec_isa_ok = True


def record_vector_isas() -> None:
    """After inductor probed the vector ISAs in this process: if every one the CPU lists
    passed, write the record that lets later starts skip the probes."""
    record = _vector_isa_record()
    if record is None or record.exists():
        return
    try:
        from torch._inductor import cpu_vec_isa

        if not cpu_vec_isa.valid_vec_isa_list.cache_info().currsize:
            return   # not probed in this process: nothing learnt
        listed = cpu_vec_isa.x86_isa_checker()
        flagged = [str(i) for i in cpu_vec_isa.supported_vec_isa_list
                   if all(f in listed for f in str(i).split())]
        probed = [str(i) for i in cpu_vec_isa.valid_vec_isa_list()]
        if probed == flagged:
            record.parent.mkdir(parents=True, exist_ok=True)
            record.write_text(" ".join(probed) + "\n")
    except Exception as exc:  # noqa: BLE001 - inductor internals moved: keep its probes
        logger.debug("vector ISA probes are not recorded: %s", exc)


def saving_enabled() -> bool:
    """Saved graphs need torch's AOT-compile API; ``LLMSERVE_SAVED_GRAPHS=0`` turns them off
    (every start then traces its graphs, reusing inductor's cache)."""
    return (os.environ.get("LLMSERVE_SAVED_GRAPHS", "1") != "0"
            and hasattr(torch.compiler, "load_compiled_function"))


def saved_graphs_dir() -> Path:
    """Where the saved graphs live: under the inductor cache (``LLMSERVE_COMPILE_CACHE``)."""
    return Path(compile_cache_dir()) / "llmserve-graphs"
