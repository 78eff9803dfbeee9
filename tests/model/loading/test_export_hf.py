"""``llmserve export-hf``: a GGUF file (or HF folder) written back as an HF folder.

The round trip: tiny random HF checkpoint -> GGUF as llama.cpp writes it (Q/K permuted) ->
export-hf -> transformers must give the original model's logits, and llmserve must load
the very same weights from the export as from the GGUF.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from llmserve.model.loading.export_hf import export_hf, hf_config_dict
from llmserve.model.loading.loader import load_checkpoint, load_model_config
from tests.model.tiny_checkpoints import make_tiny_checkpoint, make_tiny_gguf

transformers = pytest.importorskip("transformers")

PROMPT = [5, 17, 300, 42, 9, 1000, 77, 123, 4000, 11]


def hf_logits(path: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    with torch.no_grad():
        return model(torch.tensor([PROMPT])).logits[0].float()


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """(hf folder, its F32 GGUF, transformers' logits on PROMPT)."""
    root = tmp_path_factory.mktemp("export")
    hf_dir = make_tiny_checkpoint(str(root / "hf"), arch="llama", num_heads=4, num_kv_heads=2,
                                  seed=3)
    gguf = make_tiny_gguf(hf_dir, str(root / "tiny.gguf"), quant="F32")
    return hf_dir, gguf, hf_logits(hf_dir)


def test_gguf_round_trip_through_transformers(tiny_llama, tmp_path):
    hf_dir, gguf, reference = tiny_llama
    out = export_hf(gguf, str(tmp_path / "out"), "float32", tokenizer_source=hf_dir)
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json",
                                       "model.safetensors", "tokenizer.json",
                                       "tokenizer_config.json"]
    torch.testing.assert_close(hf_logits(out), reference, atol=1e-5, rtol=1e-5)
    ours = load_checkpoint(gguf).weights
    back = load_checkpoint(out).weights
    assert ours.keys() == back.keys()
    for name, tensor in ours.items():
        assert torch.equal(tensor, back[name]), name
    assert load_model_config(out).eos_token_ids == (2,)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok.chat_template and tok.encode("hello world") == transformers.AutoTokenizer \
        .from_pretrained(hf_dir).encode("hello world")


def test_bfloat16_export(tiny_llama, tmp_path):
    hf_dir, gguf, reference = tiny_llama
    out = export_hf(gguf, str(tmp_path / "bf16"), tokenizer_source=hf_dir)
    cfg = json.loads(open(os.path.join(out, "config.json")).read())
    assert cfg["dtype"] == "bfloat16" and cfg["architectures"] == ["LlamaForCausalLM"]
    weights = load_checkpoint(out, dtype="bfloat16").weights
    from safetensors import safe_open

    with safe_open(os.path.join(out, "model.safetensors"), "pt") as handle:
        assert {handle.get_tensor(n).dtype for n in handle.keys()} == {torch.bfloat16}
    assert len(weights) == len(load_checkpoint(gguf).weights)
    got = hf_logits(out, torch.bfloat16)
    assert (got - reference).abs().max() < 0.05 * reference.abs().max()


@pytest.mark.parametrize("arch,tie", [("qwen2", False), ("qwen3", True)])
def test_hf_folder_source_round_trip(arch, tie, tmp_path):
    src = make_tiny_checkpoint(str(tmp_path / "src"), arch=arch, num_heads=4, num_kv_heads=2,
                               tie=tie, seed=5)
    out = export_hf(src, str(tmp_path / "out"), "float32")
    torch.testing.assert_close(hf_logits(out), hf_logits(src), atol=1e-5, rtol=1e-5)
    from safetensors import safe_open

    with safe_open(os.path.join(out, "model.safetensors"), "pt") as handle:
        assert ("lm_head.weight" in set(handle.keys())) is not tie


def test_gguf_without_tokenizer_still_exports_weights(tiny_llama, tmp_path, caplog):
    _, gguf, _ = tiny_llama
    out = export_hf(gguf, str(tmp_path / "notok"), "float32")
    assert "no tokenizer written" in caplog.text
    assert not os.path.exists(os.path.join(out, "tokenizer.json"))
    assert os.path.isfile(os.path.join(out, "model.safetensors"))


def test_rejects_bad_arguments(tiny_llama, tmp_path):
    _, gguf, _ = tiny_llama
    with pytest.raises(ValueError, match="dtype"):
        export_hf(gguf, str(tmp_path / "x"), "int8")
    with pytest.raises(FileNotFoundError):
        export_hf(str(tmp_path / "missing.gguf"), str(tmp_path / "x"))
    config = load_model_config(gguf)
    assert hf_config_dict(config, "float32")["rope_parameters"]["rope_type"] == "default"


def test_cli_export_hf(tiny_llama, tmp_path, capsys):
    from llmserve.cli import main

    hf_dir, gguf, _ = tiny_llama
    out = tmp_path / "cli"
    assert main(["export-hf", gguf, str(out), "--dtype", "float32", "--tokenizer", hf_dir]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert (out / "tokenizer_config.json").is_file()
