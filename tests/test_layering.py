"""The layers keep their seams: the torch-free packages import without torch, and the
import contracts in pyproject.toml (run by ``lint-imports``) hold.

``lint-imports`` reads the import statements; this test imports every module of the
torch-free packages in a fresh interpreter where importing torch raises, so a module that
pulls torch in at import time through a path the static graph does not see fails too.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

# Whole packages: every module under them is imported (pkgutil.walk_packages).
NO_TORCH_PACKAGES = [
    "llmserve.engine",
    "llmserve.server",
    "llmserve.gateway",
    "llmserve.router",
    "llmserve.tokenizer",
    "llmserve.structured_output",
    "llmserve.contract",
]
# Single modules of packages that also hold torch code.
NO_TORCH_MODULES = [
    "llmserve.protocol",
    "llmserve.sampling_params",
    "llmserve.config",
    "llmserve.lora.registry",
    "llmserve.lora.engine_loras",
    "llmserve.spec_decode.decoder",
    "llmserve.spec_decode.proposers",
    "llmserve.spec_decode.wiring",
    "llmserve.eval.presets",
    "llmserve.eval.cli",
    "llmserve.eval.report",
]


def _import_without_torch(packages: list[str], modules: list[str]) -> subprocess.CompletedProcess:
    code = textwrap.dedent(f"""
        import importlib, pkgutil, sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name == "torch" or name.startswith("torch."):
                    raise ImportError("torch is not allowed here: " + name)
        sys.meta_path.insert(0, Block())
        names = list({modules!r})
        for pkg in {packages!r}:
            package = importlib.import_module(pkg)
            names += [i.name for i in pkgutil.walk_packages(package.__path__, pkg + ".")]
        for m in names:
            importlib.import_module(m)
        assert not any(k == "torch" or k.startswith("torch.") for k in sys.modules)
        print("ok", len(names))
    """)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_torch_free_layers_import_without_torch():
    r = _import_without_torch(NO_TORCH_PACKAGES, NO_TORCH_MODULES)
    assert r.returncode == 0, r.stderr
    ok, count = r.stdout.split()
    assert ok == "ok" and int(count) >= 100


def test_blocker_really_blocks_torch():
    r = _import_without_torch([], ["llmserve.model.executor.runner"])
    assert r.returncode != 0 and "torch is not allowed" in r.stderr


def test_import_contracts_hold():
    """The contracts of pyproject.toml ([tool.importlinter]): no torch in the engine core,
    server, gateway and router; the server never imports the gateway; the model layer
    reaches the engine only through the step types."""
    lint_imports = str(Path(sys.executable).with_name("lint-imports"))
    r = subprocess.run([lint_imports, "--no-cache"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
