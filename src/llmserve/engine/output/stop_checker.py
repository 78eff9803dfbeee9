"""Stop-string matching over streamed text (no torch).

Text arrives in pieces (one per step from the detokenizer), and a stop string may span
several pieces. `StopStringMatcher` therefore holds back any suffix of the text that could
still grow into a stop string, so no part of a stop string is ever shown to the client, and
releases it as soon as it can no longer match.

When several stop strings occur, the one that starts first in the text wins (the shortest
one on a tie, as it completes first). The result does not depend on how the text is split
into pieces: a match is reported only once no stop string could still start earlier.

Memory is linear in the stop strings' total length: each string is compiled once into a
KMP failure table (`StopStrings`, shared by every sequence with the same stop strings, e.g.
the `n` completions of a request), and each sequence keeps one automaton state per stop
string plus the held-back text (shorter than the longest stop string). Every character is
scanned once per stop string (amortised O(1) per string).
"""
from __future__ import annotations

import functools
import logging
from array import array
from typing import Iterable, Optional

logger = logging.getLogger(__name__)


class StopStrings:
    """Compiled stop strings: per string, its KMP failure table (read-only, shareable).

    ``failure[k][i]`` is the length of the longest proper border (prefix that is also a
    suffix) of ``strings[k][:i + 1]``.
    """

    __slots__ = ("strings", "failure")

    def __init__(self, strings: tuple[str, ...]) -> None:
        self.strings = strings
        self.failure = tuple(_failure_table(s) for s in strings)

    @property
    def num_entries(self) -> int:
        """Total size of the tables: the sum of the strings' lengths."""
        return sum(len(f) for f in self.failure)


def _failure_table(s: str) -> array:
    table = array("i", [0]) * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = table[k - 1]
        if s[i] == s[k]:
            k += 1
        table[i] = k
    return table


@functools.lru_cache(maxsize=32)
def compile_stop_strings(strings: tuple[str, ...]) -> StopStrings:
    """The compiled form of `strings`, cached so that sequences with the same stop
    strings (the `n` completions of one request) share one copy."""
    return StopStrings(strings)


class StopStringMatcher:
    """Filters one sequence's text stream for stop strings.

    `feed` returns the text that is safe to show and, once a stop string is complete, that
    string; the sequence should then finish. `flush` releases the held-back tail when the
    sequence ends for another reason (EOS, length, ...).
    """

    def __init__(
        self, stop_strings: Iterable[str], include_stop_str_in_output: bool = False
    ) -> None:
        stops = tuple(dict.fromkeys(stop_strings))  # unique, order kept
        for s in stops:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        self.stop_strings = list(stops)
        self.include_stop_str_in_output = include_stop_str_in_output
        self._compiled = compile_stop_strings(stops)
        # per stop string: length of the longest suffix of the text scanned so far that is
        # a proper prefix of it (the KMP automaton state)
        self._states = [0] * len(stops)
        self._held = ""
        self._offset = 0      # position (in the whole text) of _held[0]
        self._pos = 0         # characters scanned so far
        self._candidate: Optional[tuple[int, str]] = None  # earliest complete stop seen
        self.matched: Optional[str] = None

    @property
    def held_text(self) -> str:
        """Text received but not yet released (a possible start of a stop string)."""
        return self._held

    @property
    def compiled(self) -> StopStrings:
        """The shared compiled stop strings."""
        return self._compiled

    def feed(self, new_text: str) -> tuple[str, Optional[str]]:
        """Add text; return (text safe to emit now, the stop string matched or None).

        On a match, the text before the stop string is returned (followed by the stop
        string itself when `include_stop_str_in_output`) and anything after it is dropped,
        as is any text fed later (`matched` keeps the stop string).
        """
        if self.matched is not None:
            return "", None  # the sequence ended at the stop string; later text is dropped
        if not self.stop_strings:
            return new_text, None
        if not new_text:
            return "", None
        self._scan(new_text)
        buf = self._held + new_text
        longest = max(self._states)
        partial = self._pos - longest if longest else None  # earliest possible stop start
        candidate = self._candidate
        if candidate is not None and (partial is None or partial >= candidate[0]):
            start, match = candidate
            self.matched = match
            self._held = ""
            end = start - self._offset
            if self.include_stop_str_in_output:
                end += len(match)
            return buf[:end], match
        hold_from = self._pos if partial is None else partial
        if candidate is not None:
            hold_from = min(hold_from, candidate[0])
        cut = hold_from - self._offset
        self._held = buf[cut:]
        self._offset = hold_from
        return buf[:cut], None

    def flush(self) -> str:
        """Release the held-back text when the sequence ends for another reason.

        The held text may already contain a complete stop string that was waiting for a
        longer one starting earlier; with no more text coming it applies now: the text is
        cut there and `matched` is set (check it after flushing).
        """
        held, self._held = self._held, ""
        if held and self.matched is None and self._candidate is not None:
            start, match = self._candidate
            self.matched = match
            end = start - self._offset
            return held[: end + len(match)] if self.include_stop_str_in_output else held[:end]
        return held

    def _scan(self, text: str) -> None:
        """Advance every stop string's automaton over `text`, recording complete matches
        (earliest start first, the shorter string on a tie)."""
        strings, failure, states = self._compiled.strings, self._compiled.failure, self._states
        pos = self._pos
        candidate = self._candidate
        for ch in text:
            for k, s in enumerate(strings):
                state = states[k]
                while state and s[state] != ch:
                    state = failure[k][state - 1]
                if s[state] == ch:
                    state += 1
                    if state == len(s):
                        start = pos + 1 - state
                        if (candidate is None or start < candidate[0]
                                or (start == candidate[0] and state < len(candidate[1]))):
                            candidate = (start, s)
                        state = failure[k][state - 1]
                states[k] = state
            pos += 1
        self._pos = pos
        self._candidate = candidate
