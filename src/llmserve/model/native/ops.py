"""llmserve's own CPU kernels (``model/native/csrc/*.cpp``), compiled on the machine that runs them.

Fourteen operators, ``torch.ops.llmserve_native``:

- ``int4_mm`` / ``int8_mm`` / ``bf16_mm``: int4 (grouped) / int8 (per channel) / bf16 weights
  x bf16 activations by ``vdpbf16ps`` (:mod:`llmserve.model.quant.native_int4`,
  :mod:`~llmserve.model.quant.native_int8` and :mod:`llmserve.model.layers.native_dense`
  pack the weights and document the layouts);
- ``int4_a8_mm`` / ``int8_a8_mm``: the same int4 / int8 weights x activation rows quantized
  to int8 in blocks of 32, by ``vpdpbusd`` (they also need AVX512-VNNI: ``a8_supported``);
- ``qblock_a8_mm``: GGUF Q8_0/Q5_0/Q5_1/Q4_K/Q5_K/Q6_K weights in their own codes and scales
  x the same int8 activation rows (:mod:`llmserve.model.quant.native_qblock`; VNNI too), and
  ``qblock_rows``: rows of such a table decoded to float32 (a GGUF token table's lookup);
- ``paged_decode`` / ``paged_decode_q8``: decode attention over a bf16 / 8-bit (int8 or
  fp8 e4m3) paged KV cache, read in place (:mod:`llmserve.model.attention.native_decode`);
- ``silu_mul``: the SwiGLU activation of a fused ``[gate | up]`` output
  (:mod:`llmserve.model.layers.activation`);
- ``rotate_qk``: the rotary embedding of a prefill chunk's q and k
  (:mod:`llmserve.model.layers.rotary`); ``kv_store``: an eager step's K/V rows copied
  into the paged cache (:mod:`llmserve.model.attention.native_decode`);
- ``rms_norm`` and ``f32_mm`` (``csrc/portable/``, plain C++ built into both libraries with
  the same bits): the rows norm every path calls (:mod:`llmserve.model.layers.norm`) and
  float32 dense weights x float32 rows (:mod:`llmserve.model.layers.native_dense`).

All need AVX512F/BW and AVX512_BF16 (checked from ``/proc/cpuinfo`` and again by the library
itself) and a C++ compiler. A second library, ``torch.ops.llmserve_avx2`` (``csrc/avx2/``,
built with nothing beyond ``-mavx2 -mfma -mf16c``), serves the ``avx2`` tier: ``int4_a8_mm``
and ``int8_a8_mm`` on the same packed layouts with the same results (vpmaddubsw/vpmaddwd in
place of vpdpbusd; :func:`a8_ops` picks the namespace once), its own ``paged_decode`` (bf16,
float32 or 8-bit caches; the AVX-512 tiers load this library too, for float32 queries), and the portable ``rms_norm`` and ``f32_mm``. ``LLMSERVE_CPU_ISA`` forces a
lower tier than the CPU has, so every tier runs on one machine (:func:`cpu_tier`):
``avx512_vnni`` (everything), ``avx512_bf16`` (no int8-activation kernels), ``avx2`` (the
avx2 library's int8-activation products; PyTorch's for the rest) or ``none`` (no native
kernels: PyTorch's). The compiler is the one ``torch.compile`` needs already. The kernels are built once per
machine, torch build and source text into ``~/.cache/llmserve/kernels``
(``LLMSERVE_KERNEL_CACHE``) in seconds, loaded with ``torch.ops.load_library``, and given
fake (shape) functions so compiled graphs call them as external kernels. Where anything of
that fails, or ``LLMSERVE_NATIVE_KERNELS=0``, :func:`native_available` is false and callers
keep PyTorch's kernels: every code path runs without this library.
"""
from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

from llmserve.model.platform import cpu_flags

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
#: kernels in plain C++ that every tier's library builds for its own ISA (same bits on each)
PORTABLE_SOURCES = sorted((CSRC / "portable").glob("*.cpp"))
SOURCES = sorted(CSRC.glob("*.cpp")) + PORTABLE_SOURCES
HEADERS = sorted(CSRC.glob("*.h"))
#: the avx2 tier's library (``llmserve_avx2``): its own sources, and the operand checks
AVX2_SOURCES = sorted((CSRC / "avx2").glob("*.cpp")) + PORTABLE_SOURCES
AVX2_HEADERS = sorted((CSRC / "avx2").glob("*.h")) + [CSRC / "int4_operands.h",
                                                      CSRC / "int8_operands.h",
                                                      CSRC / "decode_operands.h",
                                                      CSRC / "row_scratch.h"]
REQUIRED_CPU_FLAGS = frozenset({"avx512f", "avx512bw", "avx512_bf16"})
#: CPU tiers, lowest first, and the flags each needs (cpuinfo names)
CPU_TIERS: "dict[str, frozenset[str]]" = {
    "none": frozenset(),
    "avx2": frozenset({"avx2", "fma", "f16c"}),
    "avx512_bf16": REQUIRED_CPU_FLAGS,
    "avx512_vnni": REQUIRED_CPU_FLAGS | {"avx512_vnni"},
}
_COMMON_FLAGS = ["-O3", "-std=c++20", "-fPIC", "-fopenmp", "-Wall", "-Wextra",
                 # vector types' alignment attributes in function-pointer templates: harmless;
                 # GCC 12's AVX-512 headers build undefined vectors as `__Y = __Y`, which
                 # -Wmaybe-uninitialized reports wherever they are inlined (a false positive)
                 "-Wno-ignored-attributes", "-Wno-maybe-uninitialized"]
_FLAGS = [*_COMMON_FLAGS, "-DLLMSERVE_LIBRARY=llmserve_native", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma"]
#: the avx2 tier: nothing beyond AVX2, FMA and F16C (an AVX2-only EPYC or desktop runs it)
_AVX2_FLAGS = [*_COMMON_FLAGS, "-DLLMSERVE_LIBRARY=llmserve_avx2", "-mavx2", "-mfma",
               "-mf16c"]
_state: "dict[str, bool]" = {}
_self_tests: "dict[str, bool]" = {}
_a8_ops: "dict[str, Any]" = {}


def cpu_tier() -> str:
    """The CPU tier the kernels use: the best this CPU has, or ``LLMSERVE_CPU_ISA`` (a tier
    name, or ``auto``) when that is lower.

    Raises:
        ValueError: an unknown ``LLMSERVE_CPU_ISA`` value.
    """
    flags = cpu_flags()
    best = [t for t, need in CPU_TIERS.items() if need <= flags][-1]
    forced = os.environ.get("LLMSERVE_CPU_ISA", "auto").strip().lower().replace("-", "_")
    if forced == "auto":
        return best
    if forced not in CPU_TIERS:
        raise ValueError(f"LLMSERVE_CPU_ISA must be auto or one of {', '.join(CPU_TIERS)}; "
                         f"got {forced!r}")
    tiers = list(CPU_TIERS)
    if tiers.index(forced) > tiers.index(best):
        logger.warning("LLMSERVE_CPU_ISA=%s: this CPU has only %s; using %s", forced, best,
                       best)
        return best
    return forced


def kernel_cache_dir() -> Path:
    return Path(os.environ.get("LLMSERVE_KERNEL_CACHE",
                               Path.home() / ".cache" / "llmserve" / "kernels"))


def _compiler() -> "str | None":
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        found = shutil.which(name) if name else None
        if found:
            return found
    return None


def _run(cmd: list[str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait(proc: subprocess.Popen, what: str) -> None:
    _, err = proc.communicate(timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} exited {proc.returncode}: {err[-2000:]}")
    if "warning" in err:   # warnings are on: a new one is shown once, when the library builds
        logger.warning("%s: compiler warnings:\n%s", what, err[-4000:])


def build(cxx: str, name: str = "llmserve_native", sources: "list[Path] | None" = None,
          headers: "list[Path] | None" = None, flags: "list[str] | None" = None) -> Path:
    """Compile ``sources`` (default: the AVX-512 library's) in parallel and link library
    ``name`` into the cache; returns its path. Concurrent builders each link to a temp file
    and rename it into place."""
    sources = SOURCES if sources is None else sources
    headers = HEADERS if headers is None else headers
    flags = _FLAGS if flags is None else flags
    torch_dir = Path(torch.__file__).parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    # torch's headers as system headers: their own warnings are not ours to fix
    includes = [f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-isystem", str(torch_dir / "include"),
                "-isystem", str(torch_dir / "include" / "torch" / "csrc" / "api" / "include")]
    libs = [f"-L{torch_dir / 'lib'}", "-lc10", "-ltorch_cpu", "-lgomp",
            f"-Wl,-rpath,{torch_dir / 'lib'}"]
    key = hashlib.sha256("\n".join([*(s.read_text() for s in sources + headers), torch.__version__,
                                    str(torch_dir), cxx, *flags, *includes, *libs]).encode())
    target = kernel_cache_dir() / f"{name}-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        logger.info("building llmserve's native CPU kernels %s (once per machine, ~10 s)", name)
        objects = [str(Path(tmp) / f"{s.stem}.o") for s in sources]
        procs = [_run([cxx, *flags, *includes, "-c", str(s), "-o", o])
                 for s, o in zip(sources, objects)]
        for proc, src in zip(procs, sources):
            _wait(proc, f"{cxx} {src.name}")
        lib = Path(tmp) / "lib.so"
        _wait(_run([cxx, "-shared", "-fopenmp", *objects, "-o", str(lib), *libs]), "link")
        os.replace(lib, target)
    return target


def _fake_int4_mm(x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor,
                  group_size: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], packed.shape[0] * 16)


def _fake_int8_mm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                  float_out: bool = False) -> torch.Tensor:
    return x.new_empty(x.shape[0], scale.shape[0],
                       dtype=torch.float32 if float_out else x.dtype)


def _fake_bf16_mm(x: torch.Tensor, packed: torch.Tensor, float_out: bool = False) -> torch.Tensor:
    return x.new_empty(x.shape[0], packed.shape[0] * 16,
                       dtype=torch.float32 if float_out else x.dtype)


def _fake_qblock_mm(x: torch.Tensor, packed: torch.Tensor, sub: torch.Tensor,
                    sup: "torch.Tensor | None", bits: int, mode: int,
                    float_out: bool = False) -> torch.Tensor:
    return x.new_empty(x.shape[0], packed.shape[0] * 16,
                       dtype=torch.float32 if float_out else x.dtype)


def _fake_qblock_rows(ids: torch.Tensor, packed: torch.Tensor, sub: torch.Tensor,
                      sup: "torch.Tensor | None", bits: int, mode: int,
                      rows: int) -> torch.Tensor:
    return ids.new_empty(ids.shape[0], sub.shape[1] * 32, dtype=torch.float32)


def _fake_paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slots: torch.Tensor, valid: torch.Tensor, scale: float,
                       softcap: float) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


def _fake_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    return gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)


def _fake_rotate_qk(cos_sin: torch.Tensor, positions: torch.Tensor, q: torch.Tensor,
                    k: torch.Tensor) -> "tuple[torch.Tensor, torch.Tensor]":
    return q.new_empty(q.shape), k.new_empty(k.shape)


def _fake_f32_mm(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], packed.shape[0] * 16)


def _fake_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _fake_kv_store(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    return None


def _load() -> bool:
    if os.environ.get("LLMSERVE_NATIVE_KERNELS", "1") == "0":
        logger.info("native CPU kernels disabled (LLMSERVE_NATIVE_KERNELS=0)")
        return False
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    tier = cpu_tier()
    if tier in ("none", "avx2"):   # below the tier whose flags the library needs
        missing = REQUIRED_CPU_FLAGS - cpu_flags()
        logger.info("native CPU kernels need %s: using PyTorch's kernels",
                    ", ".join(sorted(missing)) if missing else
                    f"the avx512_bf16 tier (LLMSERVE_CPU_ISA={tier})")
        return False
    cxx = _compiler()
    if cxx is None:
        logger.warning("no C++ compiler found: llmserve's native CPU kernels are not built "
                       "(int4 products and decode attention use slower PyTorch kernels)")
        return False
    try:
        torch.ops.load_library(str(build(cxx)))
        if not torch.ops.llmserve_native.cpu_supported():
            return False
        if not _state.get("fakes"):
            torch.library.register_fake("llmserve_native::int4_mm")(_fake_int4_mm)
            torch.library.register_fake("llmserve_native::int4_a8_mm")(_fake_int4_mm)
            torch.library.register_fake("llmserve_native::int8_mm")(_fake_int8_mm)
            torch.library.register_fake("llmserve_native::int8_a8_mm")(_fake_int8_mm)
            torch.library.register_fake("llmserve_native::bf16_mm")(_fake_bf16_mm)
            torch.library.register_fake("llmserve_native::qblock_a8_mm")(_fake_qblock_mm)
            torch.library.register_fake("llmserve_native::qblock_rows")(_fake_qblock_rows)
            torch.library.register_fake("llmserve_native::paged_decode")(_fake_paged_decode)
            torch.library.register_fake("llmserve_native::paged_decode_q8")(
                _fake_paged_decode)
            torch.library.register_fake("llmserve_native::silu_mul")(_fake_silu_mul)
            torch.library.register_fake("llmserve_native::rotate_qk")(_fake_rotate_qk)
            torch.library.register_fake("llmserve_native::kv_store")(_fake_kv_store)
            torch.library.register_fake("llmserve_native::rms_norm")(_fake_rms_norm)
            torch.library.register_fake("llmserve_native::f32_mm")(_fake_f32_mm)
            _state["fakes"] = True
    except Exception as exc:  # noqa: BLE001 - any failure: keep PyTorch's kernels
        logger.warning("llmserve's native CPU kernels are unavailable (%s): using PyTorch's",
                       exc)
        return False
    return True


def native_available() -> bool:
    """The native library is built and loaded on this machine (decided once per process)."""
    if "ok" not in _state:
        _state["ok"] = _load()
    return _state["ok"]


def _load_avx2() -> bool:
    if os.environ.get("LLMSERVE_NATIVE_KERNELS", "1") == "0":
        return False
    if platform.machine().lower() not in ("x86_64", "amd64") or cpu_tier() == "none":
        return False
    cxx = _compiler()
    if cxx is None:
        logger.warning("no C++ compiler found: the avx2 tier's kernels are not built")
        return False
    try:
        torch.ops.load_library(str(build(cxx, "llmserve_avx2", AVX2_SOURCES, AVX2_HEADERS,
                                         _AVX2_FLAGS)))
        if not torch.ops.llmserve_avx2.cpu_supported():
            return False
        torch.library.register_fake("llmserve_avx2::int4_a8_mm")(_fake_int4_mm)
        torch.library.register_fake("llmserve_avx2::int8_a8_mm")(_fake_int8_mm)
        torch.library.register_fake("llmserve_avx2::rms_norm")(_fake_rms_norm)
        torch.library.register_fake("llmserve_avx2::f32_mm")(_fake_f32_mm)
        torch.library.register_fake("llmserve_avx2::paged_decode")(_fake_paged_decode)
    except Exception as exc:  # noqa: BLE001 - any failure: keep PyTorch's kernels
        logger.warning("llmserve's avx2 kernels are unavailable (%s): using PyTorch's", exc)
        return False
    return True


def avx2_library_loaded() -> bool:
    """The avx2 tier's library (``llmserve_avx2``) is built and loaded, on any tier from
    avx2 up (decided once per process): the avx2 tier's own kernels, and on the AVX-512
    tiers its float32 ``paged_decode`` (:mod:`llmserve.model.attention.native_decode`),
    which the AVX-512 library does not have."""
    if "avx2" not in _state:
        _state["avx2"] = _load_avx2()
    return _state["avx2"]


def avx2_available() -> bool:
    """The avx2 tier's library serves this process's tier: :func:`cpu_tier` is ``avx2``
    and the library is loaded."""
    return cpu_tier() == "avx2" and avx2_library_loaded()


def a8_ops() -> "Any | None":
    """The operator namespace of the int8-activation products ``int4_a8_mm`` and
    ``int8_a8_mm`` on this CPU tier: ``torch.ops.llmserve_native`` (AVX512-VNNI),
    ``torch.ops.llmserve_avx2`` (AVX2 + FMA, the same layouts and results), or None.
    Decided once per process, so a product pays no check per call."""
    if "a8_ops" not in _a8_ops:   # every avx2 library has them; AVX-512 needs VNNI
        ops = tier_ops()
        _a8_ops["a8_ops"] = ops if ops is not None and (
            cpu_tier() == "avx2" or a8_supported()) else None
    return _a8_ops["a8_ops"]


def tier_ops() -> "Any | None":
    """The operator namespace of this CPU tier's library, for the kernels every tier's
    library builds (``csrc/portable``): ``torch.ops.llmserve_native`` (the avx512 tiers),
    ``torch.ops.llmserve_avx2`` (the avx2 tier), or None (no library: the none tier, no
    compiler, ``LLMSERVE_NATIVE_KERNELS=0``)."""
    if cpu_tier() == "avx2":
        return torch.ops.llmserve_avx2 if avx2_available() else None
    return torch.ops.llmserve_native if native_available() else None


def tier_library() -> "str | None":
    """The name of the library :func:`tier_ops` serves, or None; for the kernel plan."""
    if tier_ops() is None:
        return None
    return "llmserve_avx2" if cpu_tier() == "avx2" else "llmserve_native"


def a8_library() -> "str | None":
    """The name of the library :func:`a8_ops` serves (``llmserve_native``,
    ``llmserve_avx2``), or None; for the kernel plan."""
    return None if a8_ops() is None else tier_library()


def kernel_checked(name: str, self_test: Callable[[], bool],
                   supported: Callable[[], bool] = lambda: True,
                   library: Callable[[], bool] = native_available) -> bool:
    """``library()`` (the library the kernel lives in) is loaded, ``supported()`` (CPU
    features a kernel needs beyond the library's) holds and ``self_test`` (the kernel
    ``name`` against its PyTorch reference) passed: decided once per process and kernel; a
    failed self-test is logged."""
    if name not in _self_tests:
        runs = library() and supported()
        ok = runs and self_test()
        if runs and not ok:
            logger.warning("native %s kernel failed its self-test: PyTorch's kernels are used",
                           name)
        _self_tests[name] = ok
    return _self_tests[name]


def self_test_results() -> "dict[str, bool]":
    """Each native kernel checked so far in this process and whether it passed."""
    return dict(sorted(_self_tests.items()))


def a8_supported() -> bool:
    """The CPU has what the int8-activation kernels (``int4_a8_mm``, ``int8_a8_mm``) need
    beyond the library's features: AVX512-VNNI (the library's own check), and the CPU tier
    (``LLMSERVE_CPU_ISA``) is not forced below it."""
    return cpu_tier() == "avx512_vnni" and bool(torch.ops.llmserve_native.a8_supported())


def cut_padding(y: torch.Tensor, n: int) -> torch.Tensor:
    """The first ``n`` columns of a product whose N the packing padded to a strip multiple."""
    return y if y.shape[1] == n else y[:, :n]


def pair_strips(w: torch.Tensor) -> torch.Tensor:
    """``w (N, K)`` in the native kernels' pair layout, ``(ceil(N/16), K*16)``: strips of 16
    output rows, each as K/2 vectors of (k, k+1) pairs (element ``2c + t`` of vector ``j`` is
    ``w[16s + c][2j + t]``). N is padded with zero rows; K must be even."""
    n, k = w.shape
    if k % 2:
        raise ValueError(f"the native pair layout needs an even K, got {k}")
    pad = -n % 16
    if pad:
        w = torch.cat([w, w.new_zeros(pad, k)])
    strips = (n + pad) // 16
    return w.reshape(strips, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous().view(strips, k * 16)
