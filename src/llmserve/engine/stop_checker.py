"""Stop-string matching over streamed text (no torch).

Text arrives in pieces (one per step from the detokenizer), and a stop string may span
several pieces. `StopStringMatcher` therefore holds back any suffix of the text that could
still grow into a stop string, so no part of a stop string is ever shown to the client, and
releases it as soon as it can no longer match.

When several stop strings occur, the one that starts first in the text wins (the shortest
one on a tie, as it completes first). The result does not depend on how the text is split
into pieces: a match is reported only once no stop string could still start earlier.
"""
from __future__ import annotations

import logging
from typing import Iterable, Optional

logger = logging.getLogger(__name__)


class StopStringMatcher:
    """Filters one sequence's text stream for stop strings.

    `feed` returns the text that is safe to show and, once a stop string is complete, that
    string; the sequence should then finish. `flush` releases the held-back tail when the
    sequence ends for another reason (EOS, length, ...).
    """

    def __init__(
        self, stop_strings: Iterable[str], include_stop_str_in_output: bool = False
    ) -> None:
        stops = list(dict.fromkeys(stop_strings))  # unique, order kept
        for s in stops:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        self.stop_strings = stops
        self.include_stop_str_in_output = include_stop_str_in_output
        # Every proper prefix of a stop string: a suffix of the text equal to one may still
        # become a stop string and must be held back.
        self._prefixes = {s[:i] for s in stops for i in range(1, len(s))}
        self._max_prefix_len = max((len(s) for s in stops), default=1) - 1
        self._held = ""
        self.matched: Optional[str] = None

    @property
    def held_text(self) -> str:
        """Text received but not yet released (a possible start of a stop string)."""
        return self._held

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
        buf = self._held + new_text
        match_pos, match = self._first_match(buf)
        hold_from = self._first_partial(buf, match_pos if match is not None else len(buf))
        if match is not None and hold_from is None:
            self.matched = match
            self._held = ""
            end = match_pos + len(match) if self.include_stop_str_in_output else match_pos
            return buf[:end], match
        if hold_from is None:
            hold_from = len(buf)
        self._held = buf[hold_from:]
        return buf[:hold_from], None

    def flush(self) -> str:
        """Release the held-back text when the sequence ends for another reason.

        The held text may already contain a complete stop string that was waiting for a
        longer one starting earlier; with no more text coming it applies now: the text is
        cut there and `matched` is set (check it after flushing).
        """
        held, self._held = self._held, ""
        if held and self.matched is None:
            pos, match = self._first_match(held)
            if match is not None:
                self.matched = match
                return held[: pos + len(match)] if self.include_stop_str_in_output else held[:pos]
        return held

    def _first_match(self, buf: str) -> tuple[int, Optional[str]]:
        """Start and string of the earliest complete stop string in `buf` (shortest on ties)."""
        best_pos, best = len(buf), None
        for s in self.stop_strings:
            pos = buf.find(s, 0, best_pos + len(s))
            if pos < 0:
                continue
            if pos < best_pos or (pos == best_pos and best is not None and len(s) < len(best)):
                best_pos, best = pos, s
        return best_pos, best

    def _first_partial(self, buf: str, before: int) -> Optional[int]:
        """Earliest q < `before` where buf[q:] is a proper prefix of a stop string, or None.

        Only the last `max_prefix_len` characters can start such a suffix.
        """
        start = max(0, len(buf) - self._max_prefix_len)
        prefixes = self._prefixes
        for q in range(start, min(before, len(buf))):
            if buf[q:] in prefixes:
                return q
        return None
