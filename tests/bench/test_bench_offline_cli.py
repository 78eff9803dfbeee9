"""`llmserve bench offline` and `bench prefix` build their engines from the CLI's flags
(real subprocesses on a tiny checkpoint, eager: a few seconds each)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tests.model.tiny_checkpoints import make_tiny_checkpoint

    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("bench-offline") / "tiny"))


@pytest.mark.parametrize("command", ["offline", "prefix"])
def test_offline_benches_run_from_flags(tiny, tmp_path, command):
    out = tmp_path / "out.json"
    args = ["--num-prompts", "4", "--skip-baseline"] if command == "offline" else [
        "--num-prompts", "4", "--prefix-len", "64", "--suffix-len", "8", "--output-len", "4"]
    r = subprocess.run([sys.executable, "-m", "llmserve.cli", "--log-level", "WARNING", "bench",
                        command, "--model", tiny, "--enforce-eager", "--num-kv-blocks", "64",
                        "--json", str(out), *args],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(out.read_text())
