"""Tokenizer: a ``tokenizers.Tokenizer`` plus the special-token settings and chat template.

Loads from an HF folder (tokenizer.json + tokenizer_config.json) or rebuilds the tokenizer from
a GGUF file's metadata (byte-level BPE or SentencePiece: see :mod:`llmserve.tokenizer.gguf`). Chat templates render in a sandboxed jinja2 environment
configured the way transformers does it. No torch here.
"""
from __future__ import annotations

import datetime
import functools
import hashlib
import json
import logging
import os
from typing import Any, Iterable, Mapping, Optional, Sequence

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as BackendTokenizer

from llmserve.tokenizer.chat import encode_chat
from llmserve.tokenizer.gguf import build_gguf_tokenizer, unicode_to_byte

logger = logging.getLogger(__name__)

def _token_content(value: Any) -> Optional[str]:
    """A special token from tokenizer_config.json: a string or a serialized AddedToken dict."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def _read_json(path: str) -> dict:
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=16)
def _compile_template(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(template)


def _normalize_messages(messages: Any) -> list[dict]:
    """Validate chat messages and return copies whose ``content`` is a plain string."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    out = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"messages[{index}] must be a dict, got {type(message).__name__}")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"messages[{index}] needs a non-empty string 'role'")
        content = message.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError(f"messages[{index}].content parts must be {{'type': 'text', 'text': str}}; got {part!r}")
                texts.append(part["text"])
            content = "\n".join(texts)
        elif content is None and message.get("tool_calls"):
            content = ""
        elif not isinstance(content, str):
            raise ValueError(f"messages[{index}] needs 'content' as a string or a list of text parts")
        out.append({**message, "content": content})
    return out


class Tokenizer:
    """Text <-> token ids, special tokens, EOS set and chat template for one model.

    Build with :meth:`from_path`. Text rendered by :meth:`apply_chat_template` already holds the
    template's special tokens, so encode it with ``add_special_tokens=False``.
    """

    def __init__(self, backend: BackendTokenizer, *, bos_token: Optional[str] = None,
                 eos_token: Optional[str] = None, pad_token: Optional[str] = None,
                 unk_token: Optional[str] = None, add_bos_token: bool = False,
                 add_eos_token: bool = False, chat_template: Optional[str] = None,
                 extra_eos_token_ids: Iterable[int] = ()) -> None:
        backend.no_truncation()
        backend.no_padding()
        self._backend = backend
        self._tokens = {"bos_token": bos_token, "eos_token": eos_token, "pad_token": pad_token, "unk_token": unk_token}
        self.add_bos_token, self.add_eos_token = bool(add_bos_token), bool(add_eos_token)
        self._chat_template = chat_template
        self._bos_id, self._eos_id = self._lookup(bos_token), self._lookup(eos_token)
        self._pad_id = self._lookup(pad_token)
        self._eos_ids = frozenset(i for i in {self._eos_id, *map(int, extra_eos_token_ids)} if i is not None)
        added = backend.get_added_tokens_decoder()
        self._added_ids = frozenset(added)
        specials = {i for i, tok in added.items() if tok.special}
        specials.update(i for i in (self._bos_id, self._eos_id, self._pad_id, self._lookup(unk_token)) if i is not None)
        self._special_ids = frozenset(specials)
        #: the text of every special token (what a user must not be able to inject in a chat)
        self.special_token_strings = tuple(sorted(
            {tok.content for tok in added.values() if tok.special}
            | {t for t in self._tokens.values() if t is not None}))
        # BOS/EOS the tokenizer.json post-processor does not add itself, we add by hand.
        probe = backend.encode("a", add_special_tokens=True).ids
        self._prepend_bos = self.add_bos_token and self._bos_id is not None and probe[:1] != [self._bos_id]
        self._append_eos = self.add_eos_token and self._eos_id is not None and probe[-1:] != [self._eos_id]
        self._fingerprint: Optional[str] = None
        # byte-level vocabularies spell bytes as GPT-2 characters; SentencePiece ones use text
        self._byte_level = backend.decoder is not None and b'"ByteLevel"' in backend.decoder.__getstate__()

    def _lookup(self, token: Optional[str]) -> Optional[int]:
        if token is None:
            return None
        token_id = self._backend.token_to_id(token)
        if token_id is None:
            logger.warning("special token %r is not in the vocabulary; ignoring it", token)
        return token_id

    # ----------------------------------------------------------------- loading
    @classmethod
    def from_path(cls, path: str) -> "Tokenizer":
        """Load from an HF model folder (or its tokenizer.json) or a ``.gguf`` file."""
        if os.path.isdir(path):
            return cls._from_hf_folder(path)
        if os.path.basename(path) == "tokenizer.json" and os.path.isfile(path):
            return cls._from_hf_folder(os.path.dirname(os.path.abspath(path)))
        if os.path.isfile(path):
            return cls._from_gguf(path)
        raise FileNotFoundError(f"tokenizer path {path!r} does not exist")

    @classmethod
    def _from_hf_folder(cls, folder: str) -> "Tokenizer":
        tok_path = os.path.join(folder, "tokenizer.json")
        if not os.path.isfile(tok_path):
            raise FileNotFoundError(f"missing tokenizer.json: {tok_path!r} does not exist "
                                    "(only fast-tokenizer folders are supported)")
        backend = BackendTokenizer.from_file(tok_path)
        cfg_path = os.path.join(folder, "tokenizer_config.json")
        cfg = _read_json(cfg_path) if os.path.isfile(cfg_path) else {}
        map_path = os.path.join(folder, "special_tokens_map.json")
        special_map = _read_json(map_path) if os.path.isfile(map_path) else {}
        template = cfg.get("chat_template")
        if isinstance(template, list):   # named templates: [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_path = os.path.join(folder, "chat_template.jinja")
        if os.path.isfile(jinja_path):
            with open(jinja_path, encoding="utf-8") as handle:
                template = handle.read()
        extra_eos: list[int] = []
        for name in ("generation_config.json", "config.json"):
            candidate = os.path.join(folder, name)
            if os.path.isfile(candidate):
                extra_eos = _id_list(_read_json(candidate).get("eos_token_id"))
                if extra_eos:
                    break
        tokens = {k: _token_content(cfg.get(k, special_map.get(k)))
                  for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        return cls(backend, **tokens, add_bos_token=bool(cfg.get("add_bos_token", False)),
                   add_eos_token=bool(cfg.get("add_eos_token", False)),
                   chat_template=template if isinstance(template, str) else None,
                   extra_eos_token_ids=extra_eos)

    @classmethod
    def _from_gguf(cls, path: str) -> "Tokenizer":
        from llmserve.model.loading.gguf import read_gguf  # numpy + gguf only, no torch

        parts = build_gguf_tokenizer(read_gguf(path).metadata, path)
        return cls(parts.backend, bos_token=parts.bos_token, eos_token=parts.eos_token,
                   pad_token=parts.pad_token, unk_token=parts.unk_token,
                   add_bos_token=parts.add_bos_token, add_eos_token=parts.add_eos_token,
                   chat_template=parts.chat_template, extra_eos_token_ids=parts.extra_eos_token_ids)

    # ----------------------------------------------------------------- text <-> ids
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for ``text``; special-token strings in the text map to their ids."""
        if not isinstance(text, str):
            raise ValueError(f"text must be a string, got {type(text).__name__}")
        ids = self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self._prepend_bos and self._bos_id is not None:
            ids = [self._bos_id, *ids]
        if add_special_tokens and self._append_eos and self._eos_id is not None:
            ids = [*ids, self._eos_id]
        return ids

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: Optional[list[dict]] = None, **template_kwargs: Any) -> list[int]:
        """Token ids of a chat prompt: the template's markers are control tokens, the
        messages' text never is (see llmserve.tokenizer.chat)."""
        return encode_chat(self, messages, add_generation_prompt, tools, **template_kwargs)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text for ``ids``; special tokens are dropped unless ``skip_special_tokens`` is False."""
        ids = [int(i) for i in ids]
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
            raise ValueError(f"token ids must be in [0, {self.vocab_size}), got {min(ids)}..{max(ids)}")
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str:
        """The vocabulary string of one id (byte-level spelling, e.g. ``'Ġworld'``)."""
        token = self._backend.id_to_token(int(token_id))
        if token is None:
            raise ValueError(f"token id {token_id} is not in the vocabulary (size {self.vocab_size})")
        return token

    def token_to_id(self, token: str) -> Optional[int]:
        """The id of a vocabulary string, or None."""
        return self._backend.token_to_id(token)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (may be part of a UTF-8 character)."""
        token = self.id_to_token(token_id)
        if token_id in self._special_ids or token_id in self._added_ids:
            return token.encode("utf-8")
        to_byte = unicode_to_byte()
        if self._byte_level and all(ch in to_byte for ch in token):
            return bytes(to_byte[ch] for ch in token)
        if token.startswith("<0x") and token.endswith(">") and len(token) == 6:   # sentencepiece byte fallback
            return bytes([int(token[3:5], 16)])
        return token.replace("\u2581", " ").encode("utf-8")

    # ----------------------------------------------------------------- properties
    @property
    def backend(self) -> BackendTokenizer:
        """The wrapped ``tokenizers.Tokenizer`` (treat as read-only)."""
        return self._backend

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> Optional[int]:
        return self._bos_id

    @property
    def eos_token_id(self) -> Optional[int]:
        """The primary EOS id (the tokenizer's ``eos_token``)."""
        return self._eos_id

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Every id that ends generation: eos_token plus generation_config/GGUF EOT ids."""
        return self._eos_ids

    @property
    def pad_token_id(self) -> Optional[int]:
        return self._pad_id

    @property
    def all_special_ids(self) -> frozenset[int]:
        return self._special_ids

    @property
    def special_tokens(self) -> dict[str, Optional[str]]:
        """``bos_token``/``eos_token``/``pad_token``/``unk_token`` strings (None when unset)."""
        return dict(self._tokens)

    @property
    def chat_template(self) -> Optional[str]:
        return self._chat_template

    @property
    def fingerprint(self) -> str:
        """sha256 of the tokenizer JSON, chat template and special-token settings.

        The JSON is the backend's own serialization (its vocabulary in id order, fields in
        a fixed order), so the same tokenizer gives the same bytes however it was loaded
        (a GGUF file, or the folder ``save_pretrained`` wrote); re-sorting it cost 0.2 s of
        every start."""
        if self._fingerprint is None:
            canonical = self._backend.to_str()
            settings = json.dumps({**self._tokens, "add_bos_token": self.add_bos_token,
                                   "add_eos_token": self.add_eos_token,
                                   "eos_token_ids": sorted(self._eos_ids)}, sort_keys=True)
            digest = hashlib.sha256()
            for part in (canonical, self._chat_template or "", settings):
                digest.update(part.encode("utf-8"))
                digest.update(b"\0")
            self._fingerprint = digest.hexdigest()
        return self._fingerprint

    # ----------------------------------------------------------------- chat + saving
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: Optional[list[dict]] = None, **template_kwargs: Any) -> str:
        """Render a conversation with the model's chat template, as transformers does.

        ``content`` may be a string or a list of ``{"type": "text", "text": ...}`` parts (joined
        with newlines). Extra keyword arguments reach the template (e.g. ``enable_thinking``).

        Raises:
            ValueError: no chat template, malformed messages, or the template raised an error.
        """
        if not self._chat_template:
            raise ValueError("this tokenizer has no chat template; send a plain completion prompt instead")
        chat = _normalize_messages(messages)
        if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, Mapping) for t in tools)):
            raise ValueError("tools must be a list of JSON-schema dicts")
        context = {k: v for k, v in self._tokens.items() if v is not None}
        context.update(template_kwargs)
        try:
            return _compile_template(self._chat_template).render(
                messages=chat, tools=tools, add_generation_prompt=add_generation_prompt, **context)
        except jinja2.exceptions.TemplateError as exc:
            raise ValueError(f"chat template error: {exc}") from exc

    def save_pretrained(self, directory: str) -> None:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` (with the chat template)."""
        os.makedirs(directory, exist_ok=True)
        self._backend.save(os.path.join(directory, "tokenizer.json"))
        config: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **self._tokens,
            "add_bos_token": self.add_bos_token,
            "add_eos_token": self.add_eos_token,
            "clean_up_tokenization_spaces": False,
        }
        if self._chat_template:
            config["chat_template"] = self._chat_template
        with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as handle:
            json.dump(config, handle, indent=2, ensure_ascii=False)
