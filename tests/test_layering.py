"""The engine core, gateway and server keep their seams: they import no torch."""
from __future__ import annotations

import subprocess
import sys
import textwrap

NO_TORCH_MODULES = [
    "llmserve.engine.block_hash",
    "llmserve.engine.block_pool",
    "llmserve.engine.kv_cache_manager",
    "llmserve.engine.scheduler",
    "llmserve.engine.request",
    "llmserve.engine.core",
    "llmserve.engine.output_processor",
    "llmserve.engine.detokenizer",
    "llmserve.engine.stop_checker",
    "llmserve.engine.isolation",
    "llmserve.engine.step_isolation",
    "llmserve.engine.spec_proposer",
    "llmserve.engine.spec_decode",
    "llmserve.engine.lora_registry",
    "llmserve.server.lora_adapters",
    "llmserve.protocol",
    "llmserve.sampling_params",
    "llmserve.config",
    "llmserve.tokenizer",
    "llmserve.chat_tokens",
    "llmserve.server.app",
    "llmserve.server.limits",
    "llmserve.server.server_limits",
    "llmserve.server.openapi",
    "llmserve.server.structured_request",
    "llmserve.server.tool_calls",
    "llmserve.server.response_shaping",
    "llmserve.structured_output.spec",
    "llmserve.structured_output.compiler",
    "llmserve.structured_output.matchers",
    "llmserve.eval.presets",
    "llmserve.eval.cli",
    "llmserve.eval.report",
    "llmserve.router.router_engine",
    "llmserve.router.engine_service",
    "llmserve.router.metrics",
    "llmserve.router.engine_processes",
    "llmserve.router.cli",
]


def _import_without_torch(modules: list[str]) -> subprocess.CompletedProcess:
    code = textwrap.dedent(f"""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name == "torch" or name.startswith("torch."):
                    raise ImportError("torch is not allowed here: " + name)
        sys.meta_path.insert(0, Block())
        import importlib
        for m in {modules!r}:
            importlib.import_module(m)
        assert not any(k == "torch" or k.startswith("torch.") for k in sys.modules)
        print("ok")
    """)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_engine_core_imports_no_torch():
    r = _import_without_torch(NO_TORCH_MODULES)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_blocker_really_blocks_torch():
    r = _import_without_torch(["llmserve.model.runner"])
    assert r.returncode != 0 and "torch is not allowed" in r.stderr
