"""Chat prompts whose only control tokens are the template's own (no torch).

A chat template renders messages into one string with the model's special tokens
(``<|im_start|>``, ``<|eot_id|>`` ...) around each message's content. Encoding that string
with special-token parsing would also turn a special-token string the *user* wrote into
a control token, so a user could forge a system turn. `encode_chat` prevents that:

1. in every string of the messages (content, content parts, name; not the role) and of
   ``tools``, each special-token string, and an edge that could join the template's text
   into one (2+ characters: a proper prefix of a special-token string at the end, a
   proper suffix at the start), is replaced by a placeholder ``\\ue000<nonce>:<k>\\ue001`` (private-use characters and a
   random nonce per call, so user text cannot fake one);
2. the template is rendered with those messages;
3. the rendered text is split at the placeholders: the template's text between them is
   encoded with special-token parsing (the only special-token strings left in it are the
   template's), each placeholder's original text is encoded as plain text (`encode_plain`).

Messages without special-token strings encode exactly as before (one `encode` of the
rendered text), so prompts, prefix-cache keys and parity are unchanged for normal input.
A raw /v1/completions prompt is not a chat: special tokens in it are parsed, as OpenAI and
vLLM do.
"""
from __future__ import annotations

import functools
import logging
import re
import secrets
import threading
import weakref
from typing import Any, Optional, Sequence

from tokenizers import Tokenizer as BackendTokenizer

logger = logging.getLogger(__name__)

_plain_backends: "weakref.WeakKeyDictionary[Any, BackendTokenizer]" = weakref.WeakKeyDictionary()
_plain_lock = threading.Lock()

#: Message keys whose values are protocol, not user text.
_STRUCTURAL_KEYS = frozenset({"role", "type"})


@functools.lru_cache(maxsize=8)
def _special_pattern(strings: tuple[str, ...]) -> Optional["re.Pattern[str]"]:
    """A regex matching any of `strings`, longest first (None when there are none)."""
    strings = tuple(s for s in strings if s)
    if not strings:
        return None
    return re.compile("|".join(re.escape(s) for s in sorted(strings, key=len, reverse=True)))


class _Protector:
    """Replaces special-token strings (and dangerous edges) by numbered placeholders."""

    def __init__(self, specials: tuple[str, ...], pattern: "re.Pattern[str]") -> None:
        self.specials = specials
        self.pattern = pattern
        self.nonce = secrets.token_hex(8)
        self.originals: list[str] = []
        self.split_re = re.compile("\ue000" + self.nonce + r":(\d+)" + "\ue001")

    def _placeholder(self, text: str) -> str:
        self.originals.append(text)
        return f"\ue000{self.nonce}:{len(self.originals) - 1}\ue001"

    def _edge_lengths(self, text: str) -> tuple[int, int]:
        """Longest start of `text` that ends a special string, and longest end that begins
        one (2+ characters: a lone "<" or ">" cannot complete a token with template text)."""
        head = tail = 1
        for s in self.specials:
            top = min(len(s) - 1, len(text))
            for k in range(top, head, -1):
                if text.startswith(s[-k:]):
                    head = k
                    break
            for k in range(top, tail, -1):
                if text.endswith(s[:k]):
                    tail = k
                    break
        return (head if head > 1 else 0), (tail if tail > 1 else 0)

    def text(self, value: str) -> str:
        if not value:
            return value
        head, tail = self._edge_lengths(value)
        if head + tail >= len(value):
            return self._placeholder(value)
        middle = self.pattern.sub(lambda m: self._placeholder(m.group(0)),
                                  value[head:len(value) - tail])
        start = self._placeholder(value[:head]) if head else ""
        end = self._placeholder(value[len(value) - tail:]) if tail else ""
        return start + middle + end

    def value(self, value: Any) -> Any:
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, (list, tuple)):
            return [self.value(v) for v in value]
        if isinstance(value, dict):
            return {k: v if k in _STRUCTURAL_KEYS else self.value(v) for k, v in value.items()}
        return value


def encode_plain(tokenizer: Any, text: str) -> list[int]:
    """Token ids of `text` read as plain text: special-token strings in it are not control
    tokens (``<|im_start|>`` becomes ``<``, ``|``, ``im`` ...); no BOS/EOS.

    Uses a copy of the tokenizer's backend with ``encode_special_tokens`` set (made once
    per tokenizer; the shared backend is never switched, other threads use it).
    """
    with _plain_lock:
        plain = _plain_backends.get(tokenizer)
        if plain is None:
            plain = BackendTokenizer.from_str(tokenizer.backend.to_str())
            plain.encode_special_tokens = True
            _plain_backends[tokenizer] = plain
    return plain.encode(text, add_special_tokens=False).ids


def encode_chat(tokenizer: Any, messages: Sequence[dict], add_generation_prompt: bool = True,
                tools: Optional[list[dict]] = None, **template_kwargs: Any) -> list[int]:
    """Token ids of the chat prompt; only the template's own markers become control tokens.

    `tokenizer` is a `llmserve.tokenizer.tokenizer.Tokenizer` (needs `apply_chat_template`,
    `encode`, `backend` and `special_token_strings`).
    """
    specials = tuple(tokenizer.special_token_strings)
    pattern = _special_pattern(specials)
    if pattern is None:
        text = tokenizer.apply_chat_template(list(messages), add_generation_prompt, tools=tools,
                                             **template_kwargs)
        return tokenizer.encode(text, add_special_tokens=False)
    guard = _Protector(specials, pattern)
    safe_messages = [guard.value(m) if isinstance(m, dict) else m for m in messages]
    safe_tools = guard.value(tools) if tools is not None else None
    text = tokenizer.apply_chat_template(safe_messages, add_generation_prompt, tools=safe_tools,
                                         **template_kwargs)
    if not guard.originals:
        return tokenizer.encode(text, add_special_tokens=False)
    logger.debug("chat content holds %d special-token string(s); encoded as plain text",
                 len(guard.originals))
    parts = guard.split_re.split(text)
    ids: list[int] = []
    for i, part in enumerate(parts):
        if i % 2:
            ids.extend(encode_plain(tokenizer, guard.originals[int(part)]))
        elif part:
            ids.extend(tokenizer.encode(part, add_special_tokens=False))
    return ids
