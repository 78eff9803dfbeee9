"""The gateway package must work without torch and without the model package."""
from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import llmserve.gateway

GATEWAY_DIR = pathlib.Path(llmserve.gateway.__file__).parent
FORBIDDEN = ("torch", "llmserve.model", "llmserve.engine")

BLOCKER = """
import importlib.abc, pkgutil, sys

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if any(name == f or name.startswith(f + ".") for f in %(forbidden)r):
            raise ImportError("blocked for this test: " + name)
        return None

sys.meta_path.insert(0, Block())
import llmserve.gateway as gateway
names = [info.name for info in pkgutil.walk_packages(gateway.__path__, "llmserve.gateway.")]
for name in names:
    __import__(name)
config = gateway.GatewayConfig.open_default()
tenant = gateway.Authenticator(config).authenticate(None)
gateway.TenantRateLimiter().reserve(tenant, 10)
assert not any(m == "torch" or m.startswith(("torch.", "llmserve.model")) for m in sys.modules)
print("ok", len(names))
"""


def test_gateway_imports_with_torch_blocked():
    src = str(GATEWAY_DIR.parent.parent)
    result = subprocess.run([sys.executable, "-c", BLOCKER % {"forbidden": FORBIDDEN}],
                            capture_output=True, text=True, timeout=60, env={"PYTHONPATH": src})
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ok ") and int(result.stdout.split()[1]) >= 30


def test_no_gateway_module_imports_torch_even_lazily():
    offenders = []
    for path in sorted(GATEWAY_DIR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [f"{path.name}: {n}" for n in names
                          if any(n == f or n.startswith(f + ".") for f in FORBIDDEN)]
    assert offenders == []
