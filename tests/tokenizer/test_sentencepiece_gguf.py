"""A SentencePiece GGUF end to end: tokenizer parity with sentencepiece, greedy parity with
transformers on the same random weights, served over HTTP to the official openai client.

Everything is built at test time: a tiny BPE SentencePiece model is trained (sentencepiece,
byte fallback, a user-defined and a control symbol) on llmserve's evaluation text, a random
tiny Llama is saved as an HF folder with that vocabulary size, and ``make_tiny_gguf`` writes
the weights plus the SentencePiece vocabulary (``tokenizer.ggml.model = llama``: pieces,
scores, token types) into one GGUF file, as llama.cpp's converter does.
"""
from __future__ import annotations

import io
import os
from pathlib import Path

import pytest

from llmserve import LLM, SamplingParams
from llmserve.tokenizer.chat import encode_plain
from llmserve.tokenizer.gguf import BYTE, CONTROL, NORMAL, UNKNOWN, UNUSED, USER_DEFINED
from llmserve.tokenizer.tokenizer import Tokenizer
from tests.model.tiny_checkpoints import make_tiny_checkpoint, make_tiny_gguf

spm = pytest.importorskip("sentencepiece")

CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|user|>{{ m['content'] }}<|end|>"
                 "{% endfor %}{% if add_generation_prompt %}<|user|>{% endif %}")
TEXTS = [
    "The model reads the text.", " leading space", "two  spaces and   three", "tabs\tand\nnew\nlines\n",
    "digits 1234567890", "unknown letters: ħ ŧ 日本語 🦙 ü", "", " ", "trailing ", "x",
    "Punctuation, (brackets) [and] {braces}!?", "<s> and </s> stay text", "a<|end|>b",
]


@pytest.fixture(scope="module")
def spm_model() -> "spm.SentencePieceProcessor":
    text = Path(__file__).resolve().parents[2].joinpath(
        "src", "llmserve", "eval", "eval_text.txt").read_text(encoding="utf-8")
    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(text.splitlines()), model_writer=proto, model_type="bpe",
        vocab_size=400, byte_fallback=True, normalization_rule_name="identity",
        remove_extra_whitespaces=False, split_digits=True, allow_whitespace_only_pieces=True,
        user_defined_symbols=["<|user|>"], control_symbols=["<|end|>"], character_coverage=1.0,
        minloglevel=2, num_threads=1)
    return spm.SentencePieceProcessor(model_proto=proto.getvalue())


def _token_type(sp, i: int) -> int:
    if sp.is_unknown(i):
        return UNKNOWN
    if sp.is_control(i):
        return CONTROL
    if sp.is_byte(i):
        return BYTE
    if sp.is_unused(i):
        return UNUSED
    return USER_DEFINED if sp.id_to_piece(i) == "<|user|>" else NORMAL


@pytest.fixture(scope="module")
def spm_gguf(spm_model, tmp_path_factory) -> tuple[str, str]:
    """(HF folder, GGUF path) of one random tiny Llama with the SentencePiece vocabulary."""
    root = tmp_path_factory.mktemp("spm")
    size = spm_model.get_piece_size()
    hf_dir = make_tiny_checkpoint(str(root / "hf"), vocab_size=size, with_tokenizer=False, seed=5)

    def write_tokenizer(writer) -> None:
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list([spm_model.id_to_piece(i) for i in range(size)])
        writer.add_token_scores([spm_model.get_score(i) for i in range(size)])
        writer.add_token_types([_token_type(spm_model, i) for i in range(size)])
        writer.add_unk_token_id(spm_model.unk_id())
        writer.add_add_bos_token(True)
        writer.add_add_eos_token(False)
        writer.add_chat_template(CHAT_TEMPLATE)

    return hf_dir, make_tiny_gguf(hf_dir, str(root / "spm.gguf"), tokenizer_writer=write_tokenizer)


@pytest.fixture(scope="module")
def tokenizer(spm_gguf) -> Tokenizer:
    return Tokenizer.from_path(spm_gguf[1])


def test_encoding_matches_sentencepiece(tokenizer, spm_model):
    assert tokenizer.vocab_size == spm_model.get_piece_size()
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2) and tokenizer.add_bos_token
    for text in TEXTS:
        if "<|end|>" in text:
            continue   # sentencepiece never matches control symbols in text
        ids = encode_plain(tokenizer, text)
        assert ids == spm_model.encode(text), text
        if "<" not in text:   # else encode() parses "<s>" as the control token, as it should
            assert tokenizer.encode(text) == [1, *ids]
        assert tokenizer.decode(ids) == spm_model.decode(ids) == text
        assert b"".join(tokenizer.token_bytes(i) for i in ids) == (" " + text if text else "").encode()
    assert any(spm_model.is_byte(i) for i in encode_plain(tokenizer, "🦙"))   # byte fallback ran


def test_special_and_user_defined_symbols(tokenizer, spm_model):
    end, user = spm_model.piece_to_id("<|end|>"), spm_model.piece_to_id("<|user|>")
    # control symbols are parsed only with special tokens on; user-defined ones always,
    # with the text after them getting its own "▁" as in llama.cpp (and HF's legacy Llama)
    assert end in tokenizer.encode("a<|end|>b") and end not in encode_plain(tokenizer, "a<|end|>b")
    assert encode_plain(tokenizer, "a<|user|>b") == [*spm_model.encode("a"), user, *spm_model.encode("b")]
    assert end in tokenizer.all_special_ids and user not in tokenizer.all_special_ids
    assert tokenizer.decode([1, *tokenizer.encode("a<|end|>b", add_special_tokens=False)]) == "a b"


def test_transformers_reads_the_same_ids_from_the_gguf(spm_gguf, tokenizer):
    """transformers' own GGUF tokenizer reader agrees with llmserve's."""
    from transformers import AutoTokenizer

    hf_dir, path = spm_gguf
    theirs = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    # transformers' GGUF converter builds a non-legacy Llama tokenizer: it gives text that
    # starts with a space, or follows a special token, one "▁" less than sentencepiece and
    # llama.cpp (which llmserve follows); every other text must agree.
    for text in TEXTS:
        if text.strip() and not text.startswith(" ") and "<" not in text:
            assert theirs.encode(text) == tokenizer.encode(text), text


@pytest.fixture(scope="module")
def hf_greedy(spm_gguf):
    """Greedy continuation by transformers' Llama from the HF folder (the GGUF's weights)."""
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(spm_gguf[0], torch_dtype=torch.float32).eval()

    def generate(ids: list[int], n: int) -> list[int]:
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, pad_token_id=0)
        return out[0, len(ids):].tolist()

    return generate


PROMPTS = ["The model reads the text.", "unknown letters: ħ 日本語 🦙", "  two spaces"]


def test_greedy_tokens_equal_transformers(spm_gguf, tokenizer, hf_greedy):
    llm = LLM(spm_gguf[1], dtype="float32", num_kv_blocks=64, block_size=4, check_invariants=True)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        ids = tokenizer.encode(prompt)
        assert out.prompt_token_ids == ids and ids[0] == 1
        assert out.outputs[0].token_ids == hf_greedy(ids, 12), prompt
    assert llm.engine.kv.num_used_blocks == 0


def _engine_text(tokenizer: Tokenizer, prompt_ids: list[int], ids: list[int]) -> str:
    """The text llmserve streams for ``ids``: random weights pick random ``<0xNN>`` bytes, so
    it need not be valid UTF-8, and only the engine's detokenizer defines it then."""
    from llmserve.engine.output.detokenizer import IncrementalDetokenizer

    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    return "".join(detok.add_tokens([i]) for i in ids) + detok.flush()


def test_served_over_http_with_the_openai_client(spm_gguf, tokenizer, hf_greedy):
    import openai

    from llmserve.async_llm import AsyncLLM
    from tests.server.conftest import LiveServer

    engine = AsyncLLM(LLM(spm_gguf[1], dtype="float32", num_kv_blocks=64, block_size=4).engine)
    live = LiveServer(engine).start()
    try:
        client = openai.OpenAI(base_url=live.url("/v1"), api_key="unused", max_retries=0, timeout=60)
        prompt = PROMPTS[0]
        resp = client.completions.create(model=engine.model_name, prompt=prompt, max_tokens=10,
                                         temperature=0, logprobs=1, extra_body={"ignore_eos": True})
        ids = tokenizer.encode(prompt)
        want = hf_greedy(ids, 10)
        assert resp.usage.prompt_tokens == len(ids) and resp.usage.completion_tokens == 10
        # a token's text keeps the space its "▁" stands for
        assert resp.choices[0].logprobs.tokens == [
            tokenizer.token_bytes(i).decode("utf-8", errors="replace") for i in want]
        assert resp.choices[0].text == _engine_text(tokenizer, ids, want)
        messages = [{"role": "user", "content": "Hello <|end|> there"}]
        chat = client.chat.completions.create(model=engine.model_name, messages=messages,
                                              max_tokens=6, temperature=0,
                                              extra_body={"ignore_eos": True})
        chat_ids = tokenizer.encode_chat(messages)
        end = tokenizer.token_to_id("<|end|>")
        assert chat_ids[0] == 1 and chat_ids.count(end) == 1   # the user's "<|end|>" stays text
        assert chat.usage.prompt_tokens == len(chat_ids)
        assert chat.choices[0].message.content == _engine_text(tokenizer, chat_ids, hf_greedy(chat_ids, 6))
    finally:
        live.stop()
        engine.shutdown()
