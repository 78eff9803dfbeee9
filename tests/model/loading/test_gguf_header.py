"""The GGUF header reader: string arrays (vocabularies, merges) read in one loop, and the
parsed-header cache that lets one start read a file's header once."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFWriter

from llmserve.model.loading.gguf import read_gguf

TOKENS = ["<s>", "", "héllo", "Ġworld", "日本", "a" * 300, "\n"]


def write_gguf(path: Path, tokens: list[str], name: str = "tiny") -> None:
    writer = GGUFWriter(str(path), "llama")
    writer.add_name(name)
    writer.add_array("tokenizer.ggml.tokens", tokens)
    writer.add_array("tokenizer.ggml.scores", [float(i) for i in range(len(tokens))])
    writer.add_array("tokenizer.ggml.merges", [f"{t} {t}" for t in tokens])
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_string_arrays_read_back_exactly(tmp_path):
    path = tmp_path / "t.gguf"
    write_gguf(path, TOKENS)
    meta = read_gguf(str(path)).metadata
    assert meta["tokenizer.ggml.tokens"] == TOKENS
    assert meta["tokenizer.ggml.merges"] == [f"{t} {t}" for t in TOKENS]
    assert meta["tokenizer.ggml.scores"] == [float(i) for i in range(len(TOKENS))]
    assert meta["general.name"] == "tiny"


def test_a_truncated_string_array_is_rejected(tmp_path):
    path = tmp_path / "t.gguf"
    write_gguf(path, TOKENS)
    data = path.read_bytes()
    cut = data.index("a".encode() * 300) + 100   # inside the 300-byte token
    (tmp_path / "cut.gguf").write_bytes(data[:cut])
    with pytest.raises(ValueError, match="truncated GGUF string"):
        read_gguf(str(tmp_path / "cut.gguf"))


def test_an_unchanged_file_is_parsed_once_and_a_rewritten_one_again(tmp_path):
    path = tmp_path / "t.gguf"
    write_gguf(path, TOKENS)
    first = read_gguf(str(path))
    assert read_gguf(str(path)) is first              # the cached header
    write_gguf(path, TOKENS[:3], name="other")         # same path, new bytes
    stat = os.stat(path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))   # coarse clocks
    second = read_gguf(str(path))
    assert second is not first
    assert second.metadata["tokenizer.ggml.tokens"] == TOKENS[:3]
    assert second.metadata["general.name"] == "other"
