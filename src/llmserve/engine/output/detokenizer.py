"""Incremental detokenization that never emits half a UTF-8 character (no torch).

Byte-level tokenizers split characters across tokens: the first token of a 4-byte emoji
decodes to U+FFFD on its own, and a run of tokens may never end on a character boundary.
`IncrementalDetokenizer` decodes a short sliding window of recent token ids and tracks how
many characters of that window's text it has already emitted:

    ids:   ... | window_start ................................... len(ids)
    text:        decode(ids[window_start:]) = [ emitted | stable, new | U+FFFD tail ]

The decoded text before a trailing U+FFFD cannot change when tokens are appended (those
characters are complete), so it is emitted; the U+FFFD tail is held back because a later
token may complete it (this replaces the prefix_offset/read_offset pair of the classic
technique with a character offset, so text is released even while no token boundary falls
on a character boundary). Decoding from a window start that lies before the new tokens gives
them context, so decoders that drop a leading space at the start of a decode (SentencePiece
style) still produce it. When the window reaches `_MAX_WINDOW` tokens it is re-anchored on
its last `_ANCHOR_CONTEXT` tokens: all text but the held-back tail was emitted, so
everything before that tail in the new, shorter window counts as emitted. Each call thus
decodes O(window) tokens (one decode per call), never the whole sequence.
"""
from __future__ import annotations

import logging
from typing import Protocol, Sequence

logger = logging.getLogger(__name__)

_REPLACEMENT = "\ufffd"
# Prompt tokens decoded as context before the first output token.
_PROMPT_CONTEXT_TOKENS = 5
# Tokens kept when the window is re-anchored: enough to hold the bytes of an incomplete
# character (at most 3) plus leading-space context.
_ANCHOR_CONTEXT = 6
# Largest number of tokens decoded per call (one token at a time).
_MAX_WINDOW = 24
# A UTF-8 character has at most 4 bytes, so at most 3 of them can be waiting for the rest.
_MAX_HELD_CHARS = 3


class SupportsDecode(Protocol):
    """The part of a tokenizer the detokenizer needs."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


def _stable_length(text: str) -> int:
    """Length of `text` without the U+FFFD at its end that a later token may still complete.

    An incomplete character decodes to one U+FFFD (lossy UTF-8) or one per byte (byte
    fallback), so at most `_MAX_HELD_CHARS` of a trailing U+FFFD run are held; any before
    them stand for genuinely invalid bytes and are final.
    """
    if not text.endswith(_REPLACEMENT):
        return len(text)
    run = len(text) - len(text.rstrip(_REPLACEMENT))
    return len(text) - min(run, _MAX_HELD_CHARS)


class IncrementalDetokenizer:
    """Turns a stream of output token ids into text pieces, one call per step.

    The pieces concatenate to ``tokenizer.decode(output_ids)`` for output that is valid
    UTF-8; no piece ends inside a character and no U+FFFD is emitted for a character
    that a later token completes (invalid bytes show as U+FFFD once text follows them,
    or at `flush`).
    """

    def __init__(
        self,
        tokenizer: SupportsDecode,
        prompt_token_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._window_start = 0
        context = self._decode_window() if self._ids else ""
        if context.endswith(_REPLACEMENT):
            # The prompt ends inside a character: the first output bytes would complete it.
            self._ids, context = [], ""
        self._emitted = len(context)  # characters of decode(ids[window_start:]) already out
        self._num_output = 0
        self._pieces: list[str] = []

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    @property
    def num_output_tokens(self) -> int:
        return self._num_output

    def add_tokens(self, new_ids: Sequence[int]) -> str:
        """Append output token ids and return the text they complete (possibly "")."""
        if not new_ids:
            return ""
        self._ids.extend(new_ids)
        self._num_output += len(new_ids)
        window = self._decode_window()
        stable = _stable_length(window)
        piece = ""
        if stable > self._emitted:
            piece = window[self._emitted:stable]
            self._emitted = stable
            self._pieces.append(piece)
        if len(self._ids) - self._window_start >= _MAX_WINDOW:
            self._reanchor(held=len(window) - self._emitted)
        return piece

    def flush(self) -> str:
        """Emit whatever is still held back, even an invalid UTF-8 tail (as U+FFFD)."""
        window = self._decode_window()
        if len(window) <= self._emitted:
            return ""
        piece = window[self._emitted:]
        self._emitted = len(window)
        self._pieces.append(piece)
        return piece

    def _reanchor(self, held: int) -> None:
        """Shrink the window to its last tokens, keeping the `held` trailing characters unsent.

        The held tail (an incomplete character) lies within the kept tokens and decodes the
        same at the end of the new window; everything before it there was already emitted
        (leading U+FFFD from cut characters included, which must never be emitted).
        """
        self._window_start = len(self._ids) - _ANCHOR_CONTEXT
        if self._window_start >= _MAX_WINDOW:  # keep the id list O(window) as well
            del self._ids[: self._window_start]
            self._window_start = 0
        self._emitted = max(0, len(self._decode_window()) - held)

    def _decode_window(self) -> str:
        return self._tokenizer.decode(
            self._ids[self._window_start:], skip_special_tokens=self._skip_special
        )
