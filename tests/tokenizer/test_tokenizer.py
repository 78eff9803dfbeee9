"""Tokenizer: parity with transformers on the default GGUF, chat templates, HF folders, fingerprint."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from llmserve.default_model import default_model_path
from llmserve.tokenizer.tokenizer import Tokenizer
from tests.model.tiny_checkpoints import default_tokenizer

CHATML_TURNS = (
    "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
    "<|im_start|>assistant\n4<|im_end|>\n<|im_start|>assistant\n"
)
TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "12345",
    "Prices: $3.50, 1,000,000 units in 2024 (v1.2.3)",
    "def add(a, b):\n    return a + b  # sum\n\n\tprint(add(1, 2))\n",
    "  leading spaces, trailing spaces   ",
    "line one\nline two\r\n\n\nline five",
    "你好，世界！日本語のテキスト、한국어",
    "emoji 🙂🚀👩‍👩‍👧 mixed ñandú café",
    "don't I'll WE'RE you've",
    CHATML_TURNS,
    "<|endoftext|>text after<repo_name>name",
    "",
]
CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."},
     {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another?"}],
]


@pytest.fixture(scope="module")
def ours() -> Tokenizer:
    return default_tokenizer()


@pytest.fixture(scope="module")
def hf_tok():
    from transformers import AutoTokenizer

    path = default_model_path()
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def test_default_gguf_tokenizer_settings(ours):
    assert ours.vocab_size == 49152
    assert ours.bos_token_id == 1 and ours.id_to_token(1) == "<|im_start|>"
    assert ours.eos_token_ids == frozenset({2}) and ours.id_to_token(2) == "<|im_end|>"
    assert ours.all_special_ids == frozenset(range(17))   # the 17 control tokens of SmolLM2
    assert not ours.add_bos_token
    assert ours.chat_template is not None and "<|im_start|>" in ours.chat_template
    assert ours.encode("hi", add_special_tokens=True) == ours.encode("hi", add_special_tokens=False)


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_encode_and_decode_match_transformers(ours, hf_tok, text):
    ids = ours.encode(text)
    assert ids == hf_tok.encode(text)
    assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.decode(ids, skip_special_tokens=False) == hf_tok.decode(ids, skip_special_tokens=False)
    assert ours.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)


@pytest.mark.slow
def test_special_ids_match_transformers(ours, hf_tok):
    special_added = {i for i, tok in hf_tok.added_tokens_decoder.items() if tok.special}
    assert ours.all_special_ids == frozenset(special_added) | frozenset(hf_tok.all_special_ids)
    assert ours.bos_token_id == hf_tok.bos_token_id and ours.eos_token_id == hf_tok.eos_token_id
    assert ours.encode(CHATML_TURNS)[:2] == [1, hf_tok.convert_tokens_to_ids("system")]


def test_digits_are_isolated_as_llama_cpp_smollm_does(ours):
    """`tokenizer.ggml.pre = "smollm"`: llama.cpp first splits every \\p{N}, then the GPT-2 regex.

    transformers' GGUF converter skips the digit split, so it differs from llama.cpp (and from the
    original SmolLM2 tokenizer.json, Digits + ByteLevel) when whitespace precedes a number.
    """
    token = ours.token_to_id
    assert ours.encode("  12") == [token("ĠĠ"), token("1"), token("2")]
    assert ours.encode("x  2024") == [token("x"), token("ĠĠ"), token("2"), token("0"), token("2"), token("4")]
    assert ours.decode(ours.encode("a\u00a0\u0663\u0664 7")) == "a\u00a0\u0663\u0664 7"


def test_decode_round_trips_and_token_bytes(ours):
    for text in TEXTS:
        ids = ours.encode(text)
        assert ours.decode(ids, skip_special_tokens=False) == text
        assert b"".join(ours.token_bytes(i) for i in ids) == text.encode("utf-8")
    assert ours.decode(ours.encode(CHATML_TURNS)) == CHATML_TURNS.replace("<|im_start|>", "").replace("<|im_end|>", "")
    with pytest.raises(ValueError, match="token ids must be in"):
        ours.decode([49152])
    with pytest.raises(ValueError, match="not in the vocabulary"):
        ours.id_to_token(10**6)


@pytest.mark.slow
@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(ours, hf_tok, conversation, add_generation_prompt):
    expected = hf_tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt) == expected


def test_chat_content_parts_and_validation(ours):
    plain = [{"role": "user", "content": "first\nsecond"}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]}]
    assert ours.apply_chat_template(parts) == ours.apply_chat_template(plain)
    assert ours.apply_chat_template(plain).endswith("<|im_start|>user\nfirst\nsecond<|im_end|>\n<|im_start|>assistant\n")
    bad = {
        "non-empty list": [],
        "string 'role'": [{"content": "x"}],
        "'content' as a string": [{"role": "user", "content": 5}],
        "must be a dict": ["hello"],
        "content parts": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
    }
    for message, messages in bad.items():
        with pytest.raises(ValueError, match=message):
            ours.apply_chat_template(messages)
    assert parts[0]["content"][0] == {"type": "text", "text": "first"}   # caller's messages untouched


def _with_template(folder: str, template) -> Tokenizer:
    config_path = os.path.join(folder, "tokenizer_config.json")
    with open(config_path, encoding="utf-8") as handle:
        config = json.load(handle)
    config["chat_template"] = template
    if template is None:
        config.pop("chat_template")
    with open(config_path, "w", encoding="utf-8") as handle:
        json.dump(config, handle)
    return Tokenizer.from_path(folder)


def test_template_errors_and_helpers(ours, tmp_path):
    ours.save_pretrained(str(tmp_path))
    strict = _with_template(str(tmp_path), "{% if messages[0]['role'] != 'user' %}"
                            "{{ raise_exception('first message must be from the user') }}{% endif %}"
                            "{{ bos_token }}{% for m in messages %}\n  {% if m %}{{ m['content'] | tojson }}{% endif %}\n{% endfor %}")
    with pytest.raises(ValueError, match="first message must be from the user"):
        strict.apply_chat_template([{"role": "assistant", "content": "hi"}])
    rendered = strict.apply_chat_template([{"role": "user", "content": "héllo \"q\""}])
    assert rendered == '<|im_start|>"héllo \\"q\\""'   # trim_blocks + lstrip_blocks; tojson keeps non-ASCII
    none = _with_template(str(tmp_path), None)
    with pytest.raises(ValueError, match="no chat template"):
        none.apply_chat_template([{"role": "user", "content": "hi"}])


def test_save_pretrained_round_trip_and_fingerprint(ours, tmp_path):
    ours.save_pretrained(str(tmp_path))
    loaded = Tokenizer.from_path(str(tmp_path))
    assert loaded.fingerprint == ours.fingerprint
    for text in TEXTS + ["  12"]:
        assert loaded.encode(text) == ours.encode(text)
    assert loaded.apply_chat_template(CONVERSATIONS[1]) == ours.apply_chat_template(CONVERSATIONS[1])
    assert (loaded.bos_token_id, loaded.eos_token_ids, loaded.all_special_ids) == \
        (ours.bos_token_id, ours.eos_token_ids, ours.all_special_ids)
    changed = _with_template(str(tmp_path), ours.chat_template.replace("helpful", "useful"))
    assert changed.fingerprint != ours.fingerprint
    assert len(changed.fingerprint) == 64


def test_hf_folder_settings_bos_and_extra_eos(ours, tmp_path):
    ours.save_pretrained(str(tmp_path))
    with open(tmp_path / "generation_config.json", "w", encoding="utf-8") as handle:
        json.dump({"eos_token_id": [2, 0]}, handle)
    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["add_bos_token"] = True
    config_path.write_text(json.dumps(config), encoding="utf-8")
    tok = Tokenizer.from_path(str(tmp_path))
    assert tok.eos_token_ids == frozenset({0, 2}) and tok.eos_token_id == 2
    assert tok.encode("hi") == [1] + ours.encode("hi")
    assert tok.encode("hi", add_special_tokens=False) == ours.encode("hi")
    assert tok.fingerprint != ours.fingerprint
    os.remove(tmp_path / "tokenizer.json")
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_path(str(tmp_path))


@pytest.mark.slow
def test_transformers_reads_our_saved_folder(ours, tmp_path):
    from transformers import AutoTokenizer

    ours.save_pretrained(str(tmp_path))
    theirs = AutoTokenizer.from_pretrained(str(tmp_path))
    for text in TEXTS + ["  12"]:
        assert theirs.encode(text) == ours.encode(text)
    assert theirs.apply_chat_template(CONVERSATIONS[1], tokenize=False, add_generation_prompt=True) == \
        ours.apply_chat_template(CONVERSATIONS[1])


def test_gguf_tokenizer_loads_without_torch(ours):
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch' or name.startswith('torch.'):\n"
        "            raise ImportError('torch blocked')\n"
        "sys.meta_path.insert(0, Block())\n"
        "from llmserve.default_model import default_model_path\n"
        "from llmserve.tokenizer.tokenizer import Tokenizer\n"
        "tok = Tokenizer.from_path(default_model_path())\n"
        "print(tok.encode('Hello world'))\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(ours.encode("Hello world"))
