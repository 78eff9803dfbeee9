"""Rebuild a GGUF file's tokenizer as a ``tokenizers.Tokenizer`` that encodes as llama.cpp does.

Three GGUF tokenizer models (``tokenizer.ggml.model``) are supported:

* ``gpt2``: byte-level BPE. The merges are in the file; the text split comes from the
  ``tokenizer.ggml.pre`` name (:mod:`llmserve.tokenizer.gguf_pretokenizers`).
* ``llama``: SentencePiece BPE (Llama 2, Mistral, TinyLlama, Phi-3, Gemma ...). The file has
  scores instead of merges. SentencePiece repeatedly joins the adjacent pair whose joined text
  is the vocabulary piece with the highest score; a BPE model whose merge list holds every
  way to split each piece into two pieces, ranked by the joined piece's score, makes the
  same choices. Spaces become ``▁``; one ``▁`` is prepended to every run of text
  (``tokenizer.ggml.add_space_prefix``, default on); characters outside the vocabulary fall
  back to their UTF-8 bytes as ``<0xNN>`` pieces.
* ``gemma4``: BPE over raw UTF-8 with ``▁`` for spaces, merges in the file, text split only
  at newline runs, byte fallback like SentencePiece.

Special tokens: control and unknown-type tokens become special added tokens (matched in
text only when special tokens are parsed); user-defined tokens become plain added tokens,
always matched in raw text first, as llama.cpp does; any characters are allowed. The
encoder-only models (``bert`` WordPiece, ``t5`` Unigram) and others raise
:class:`UnsupportedTokenizerError` naming the model.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from llmserve.tokenizer.gguf_pretokenizers import UnsupportedTokenizerError, pre_tokenizer_for, split_rule_for

logger = logging.getLogger(__name__)

# GGUF token types (llama.cpp's llama_token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
_SPACE = "\u2581"
_ENCODER_MODELS = {"bert": "WordPiece (BERT)", "t5": "Unigram (T5)"}


@dataclass(frozen=True)
class GGUFTokenizerParts:
    """What :class:`llmserve.tokenizer.tokenizer.Tokenizer` needs, read from a GGUF file."""

    backend: BackendTokenizer
    bos_token: Optional[str]
    eos_token: Optional[str]
    pad_token: Optional[str]
    unk_token: Optional[str]
    add_bos_token: bool
    add_eos_token: bool
    chat_template: Optional[str]
    extra_eos_token_ids: tuple[int, ...]


@functools.lru_cache(maxsize=1)
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    unprintable = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(unprintable)}}


@functools.lru_cache(maxsize=1)
def unicode_to_byte() -> dict[str, int]:
    """Inverse of :func:`byte_to_unicode`."""
    return {char: byte for byte, char in byte_to_unicode().items()}


def build_gguf_tokenizer(meta: Mapping[str, Any], source: str) -> GGUFTokenizerParts:
    """The tokenizer described by a GGUF file's metadata (``source`` names it in errors).

    Raises:
        UnsupportedTokenizerError: an encoder-only or unknown tokenizer model, or an unknown
            pre-tokenizer name.
        ValueError: malformed tokenizer metadata.
    """
    kind = meta.get("tokenizer.ggml.model")
    tokens: list[str] = list(meta.get("tokenizer.ggml.tokens") or [])
    if not tokens:
        raise ValueError(f"{source!r}: GGUF has no tokenizer.ggml.tokens")
    types = list(meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
    if len(types) != len(tokens):
        raise ValueError(f"{source!r}: {len(types)} token types for {len(tokens)} tokens")
    if kind == "gpt2":
        try:
            rule = split_rule_for(meta.get("tokenizer.ggml.pre"))
        except UnsupportedTokenizerError as exc:
            raise UnsupportedTokenizerError(f"{source!r}: {exc}") from None
        backend, vocab = _byte_level_bpe(meta, tokens, types, rule.ignore_merges, source)
        backend.pre_tokenizer = pre_tokenizer_for(rule)
        add_bos_default, defaults = rule.add_bos, {}
    elif kind == "llama":
        backend, vocab = _sentencepiece(meta, tokens, types, source)
        add_bos_default, defaults = True, {"bos": 1, "eos": 2, "unk": 0}
    elif kind == "gemma4":
        backend, vocab = _newline_split_bpe(meta, tokens, types, source)
        add_bos_default, defaults = True, {}
    elif kind in _ENCODER_MODELS:
        raise UnsupportedTokenizerError(
            f"{source!r}: GGUF tokenizer model {kind!r} ({_ENCODER_MODELS[kind]}, an encoder "
            "vocabulary) is not supported; llmserve serves decoder models with 'gpt2' "
            "(byte-level BPE), 'llama' (SentencePiece) or 'gemma4' tokenizers")
    else:
        raise UnsupportedTokenizerError(
            f"{source!r}: GGUF tokenizer model {kind!r} is not supported (supported: "
            "'gpt2' byte-level BPE, 'llama' SentencePiece, 'gemma4')")
    _add_special_tokens(backend, tokens, types, _rstrip_ids(meta, tokens, types))

    def token_of(key: str, default: Optional[int] = None) -> Optional[str]:
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id", default)
        if token_id is None or not 0 <= int(token_id) < len(tokens):
            return None
        return tokens[int(token_id)]

    bos, eos = token_of("bos", defaults.get("bos")), token_of("eos", defaults.get("eos"))
    add_bos = bos is not None and (
        bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default)) or kind == "gemma4")
    add_eos = eos is not None and bool(meta.get("tokenizer.ggml.add_eos_token", False))
    processor = _bos_eos_processor(bos if add_bos else None, eos if add_eos else None, vocab)
    if processor is not None:
        backend.post_processor = processor
    extra = tuple(int(meta[k]) for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
                  if k in meta)
    return GGUFTokenizerParts(
        backend, bos_token=bos, eos_token=eos, pad_token=token_of("padding"),
        unk_token=token_of("unknown", defaults.get("unk")), add_bos_token=add_bos,
        add_eos_token=add_eos, chat_template=meta.get("tokenizer.chat_template"),
        extra_eos_token_ids=extra)


def _raw_vocab(tokens: Sequence[str], source: str) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        if token in vocab:
            raise ValueError(f"{source!r}: token text {token!r} appears twice (ids {vocab[token]} "
                             f"and {index}); llama.cpp refuses such a vocabulary too")
        vocab[token] = index
    return vocab


def _parse_merges(meta: Mapping[str, Any], vocab: Mapping[str, int]) -> list[tuple[str, str]]:
    """``"left right"`` merges split at the first space after the first character (a left
    part may itself be a space); merges naming text outside the vocabulary are dropped."""
    merges = []
    for merge in meta.get("tokenizer.ggml.merges") or []:
        cut = merge.find(" ", 1)
        if cut < 0:
            continue
        left, right = merge[:cut], merge[cut + 1:]
        if left in vocab and right in vocab and left + right in vocab:
            merges.append((left, right))
    return merges


def _byte_level_bpe(meta: Mapping[str, Any], tokens: Sequence[str], types: Sequence[int],
                    ignore_merges: bool, source: str) -> tuple[BackendTokenizer, dict[str, int]]:
    vocab = _raw_vocab(tokens, source)
    alphabet, spell = set(unicode_to_byte()), byte_to_unicode()
    for index, token in enumerate(tokens):
        # A normal token stored as raw text (some converters): spell it in the byte alphabet.
        if types[index] == NORMAL and not set(token) <= alphabet:
            respelled = "".join(spell[b] for b in token.encode("utf-8"))
            if respelled not in vocab:
                del vocab[token]
                vocab[respelled] = index
    merges = _parse_merges(meta, vocab)
    backend = BackendTokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False,
                                          ignore_merges=ignore_merges))
    backend.decoder = decoders.ByteLevel()
    return backend, vocab


def _sentencepiece(meta: Mapping[str, Any], tokens: Sequence[str], types: Sequence[int],
                   source: str) -> tuple[BackendTokenizer, dict[str, int]]:
    vocab = _raw_vocab(tokens, source)
    scores = meta.get("tokenizer.ggml.scores")
    if scores is None or len(scores) < len(tokens):
        raise ValueError(f"{source!r}: a SentencePiece GGUF needs tokenizer.ggml.scores for every token")
    normal = {token for token, kind in zip(tokens, types) if kind == NORMAL}
    # Pieces from the highest score down (ties: lower id first); each adds every split of
    # itself into two pieces, so a merge's rank is its result's rank.
    order = sorted((i for i, kind in enumerate(types) if kind == NORMAL),
                   key=lambda i: (-float(scores[i]), i))
    merges: list[tuple[str, str]] = []
    for index in order:
        token = tokens[index]
        merges.extend((token[:cut], token[cut:]) for cut in range(1, len(token))
                      if token[:cut] in normal and token[cut:] in normal)
    unk_id = int(meta.get("tokenizer.ggml.unknown_token_id", 0))
    unk = tokens[unk_id] if 0 <= unk_id < len(tokens) else None
    backend = BackendTokenizer(models.BPE(vocab, merges, unk_token=unk, fuse_unk=True,
                                          byte_fallback=True))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    steps = [normalizers.Prepend(_SPACE)] if prefix else []
    backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", _SPACE)])
    backend.decoder = _space_piece_decoder(strip_first_space=prefix)
    return backend, vocab


def _newline_split_bpe(meta: Mapping[str, Any], tokens: Sequence[str], types: Sequence[int],
                       source: str) -> tuple[BackendTokenizer, dict[str, int]]:
    vocab = _raw_vocab(tokens, source)
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[int(unk_id)] if unk_id is not None and 0 <= int(unk_id) < len(tokens) else None
    backend = BackendTokenizer(models.BPE(vocab, _parse_merges(meta, vocab), unk_token=unk,
                                          fuse_unk=True, byte_fallback=True))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", False))
    steps = [normalizers.Prepend(_SPACE)] if prefix else []
    backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", _SPACE)])
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^\n]+|\n+"), behavior="isolated")
    backend.decoder = _space_piece_decoder(strip_first_space=prefix)
    return backend, vocab


def _space_piece_decoder(strip_first_space: bool) -> decoders.Decoder:
    steps = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if strip_first_space:
        steps.append(decoders.Strip(" ", 1, 0))
    return decoders.Sequence(steps)


def _rstrip_ids(meta: Mapping[str, Any], tokens: Sequence[str], types: Sequence[int]) -> set[int]:
    """Phi-3's special tokens swallow the whitespace after them (its tokenizer.json says
    ``rstrip``; the GGUF does not, so llama.cpp recognises the model by name, as here)."""
    name = str(meta.get("general.name", "")).lower()
    if "phi-3" not in name and "phi3" not in name:
        return set()
    keep = {"<unk>", "<s>", "<|endoftext|>"}
    return {i for i, (token, kind) in enumerate(zip(tokens, types))
            if (kind in (CONTROL, USER_DEFINED, UNKNOWN) or token == "</s>") and token not in keep}


def _add_special_tokens(backend: BackendTokenizer, tokens: Sequence[str], types: Sequence[int],
                        rstrip: set[int]) -> None:
    special, plain = [], []
    for index, (token, kind) in enumerate(zip(tokens, types)):
        if kind in (CONTROL, UNKNOWN):
            special.append(AddedToken(token, special=True, normalized=False, rstrip=index in rstrip))
        elif kind == USER_DEFINED:
            plain.append(AddedToken(token, special=False, normalized=False, rstrip=index in rstrip))
    backend.add_special_tokens(special)
    backend.add_tokens(plain)


def _bos_eos_processor(bos: Optional[str], eos: Optional[str],
                       vocab: Mapping[str, int]) -> Optional[processors.PostProcessor]:
    """A post-processor adding BOS/EOS, or None when none is added or a token's text cannot
    be written in a template (then :class:`~llmserve.tokenizer.tokenizer.Tokenizer` adds them itself)."""
    named = [t for t in (bos, eos) if t is not None]
    if not named or any(ch.isspace() or ch in ":$" for t in named for ch in t):
        return None
    head = f"{bos}:0 " if bos is not None else ""
    tail, tail_b = (f" {eos}:0", f" {eos}:1") if eos is not None else ("", "")
    second = f" {bos}:1" if bos is not None else ""
    return processors.TemplateProcessing(
        single=f"{head}$A:0{tail}", pair=f"{head}$A:0{tail}{second} $B:1{tail_b}",
        special_tokens=[(t, vocab[t]) for t in dict.fromkeys(named)])
