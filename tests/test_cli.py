"""The `llmserve` command line: real subprocesses, exit codes and messages."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.model.tiny_checkpoints import make_tiny_checkpoint


def run(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmserve.cli", "--log-level", "WARNING", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_generate_streams_completion(tmp_path):
    path = make_tiny_checkpoint(str(tmp_path / "m"), arch="llama", num_heads=4, num_kv_heads=2)
    r = run("generate", "--model", path, "--max-tokens", "8", "--num-kv-blocks", "32", "Hello")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()  # some text came out


@pytest.mark.slow
def test_generate_chat_default_model():
    r = run("generate", "--chat", "--max-tokens", "24", "--num-kv-blocks", "64", "--dtype", "float32",
            "What is the capital of France?")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


def test_missing_model_is_a_clear_error(tmp_path):
    r = run("generate", "--model", str(tmp_path / "nope"), "hi")
    assert r.returncode == 2
    assert "nope" in r.stderr and "Traceback" not in r.stderr


def test_invalid_sampling_value_is_a_clear_error(tmp_path):
    r = run("generate", "--top-p", "1.5", "hi")
    assert r.returncode == 2
    assert "top_p" in r.stderr and "Traceback" not in r.stderr


def test_unknown_architecture_is_a_clear_error(tmp_path):
    d = tmp_path / "weird"
    d.mkdir()
    (d / "config.json").write_text('{"architectures": ["FancyForCausalLM"]}')
    r = run("generate", "--model", str(d), "hi")
    assert r.returncode == 2
    assert "FancyForCausalLM" in r.stderr and "Traceback" not in r.stderr


def test_speculative_flags_generate_and_clear_errors(tmp_path):
    path = make_tiny_checkpoint(str(tmp_path / "m"), arch="llama", num_heads=4, num_kv_heads=2)
    r = run("generate", "--model", path, "--max-tokens", "8", "--num-kv-blocks", "32",
            "--speculative-method", "ngram", "--num-speculative-tokens", "3",
            "--ngram-min", "2", "--ngram-max", "3", "Hello Hello Hello")
    assert r.returncode == 0, r.stderr
    r = run("generate", "--model", path, "--speculative-method", "draft", "hi")
    assert r.returncode == 2
    assert "draft_model" in r.stderr and "Traceback" not in r.stderr
    r = run("generate", "--model", path, "--speculative-method", "ngram", "--ngram-min", "5",
            "--ngram-max", "2", "hi")
    assert r.returncode == 2
    assert "ngram_min" in r.stderr and "Traceback" not in r.stderr
    r = run("generate", "--model", path, "--max-tokens", "8", "--num-kv-blocks", "32",
            "--speculative-method", "suffix", "--suffix-min-confidence", "0.3",
            "Hello Hello Hello")
    assert r.returncode == 0, r.stderr
    r = run("generate", "--model", path, "--speculative-method", "suffix",
            "--suffix-min-confidence", "1.5", "hi")
    assert r.returncode == 2
    assert "suffix_min_confidence" in r.stderr and "Traceback" not in r.stderr


def test_lora_flags_give_clear_errors(tmp_path):
    r = run("generate", "--lora-modules", "no-equals-sign", "hi")
    assert r.returncode == 2 and "NAME=PATH" in r.stderr
    path = make_tiny_checkpoint(str(tmp_path / "m"), arch="llama", num_heads=4, num_kv_heads=2)
    r = run("generate", "--model", path, "--num-kv-blocks", "32", "hi", "--lora-modules",
            f"sql={tmp_path / 'no-adapter'}")
    assert r.returncode == 2
    assert "no-adapter" in r.stderr and "does not exist" in r.stderr
    assert "Traceback" not in r.stderr


def test_serve_refuses_a_served_model_name_that_would_break_headers():
    """A name with a newline would reach X-Served-By and break every response: refused
    before the model loads, with the rule in the message."""
    r = run("serve", "--served-model-name", "bad\nname", timeout=60)
    assert r.returncode == 2, r.stderr
    assert "--served-model-name 'bad\\nname' is not a valid name" in r.stderr

