"""Stop strings: memory linear in their total length, shared across a request's sequences."""
from __future__ import annotations

import random
import tracemalloc

from llmserve.engine.output.stop_checker import StopStringMatcher


def _stop(length: int) -> str:
    rng = random.Random(length)
    return "".join(rng.choice("abcdefgh") for _ in range(length))


def test_long_stop_string_memory_is_linear_and_shared():
    # The attack: one very long stop string, n=8 completions. Storing every prefix
    # of a 5,000-character stop string costs ~12.5 M characters per sequence; the compiled
    # matcher holds one 4-byte entry per character, shared by the 8 sequences.
    stop = _stop(5_000)
    tracemalloc.start()
    try:
        matchers = [StopStringMatcher([stop, "z" * 100]) for _ in range(8)]
        for m in matchers:
            for i in range(0, len(stop) - 1, 97):   # all but the last character: held back
                m.feed(stop[i:min(i + 97, len(stop) - 1)])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000, peak
    assert all(m.compiled is matchers[0].compiled for m in matchers)
    assert matchers[0].compiled.num_entries == len(stop) + 100
    for m in matchers:
        assert len(m.held_text) <= len(stop) - 1
        assert m.matched is None


def test_long_stop_string_matches_across_many_pieces():
    stop = _stop(3_000)
    m = StopStringMatcher([stop])
    text = "head " + stop[:-1] + "x" + stop + " tail"   # a near miss, then the real one
    shown = []
    for i in range(0, len(text), 13):
        out, matched = m.feed(text[i:i + 13])
        shown.append(out)
        if matched:
            break
    assert matched == stop
    assert "".join(shown) == "head " + stop[:-1] + "x"


def test_long_stop_strings_match_reference_for_any_chunking():
    rng = random.Random(1)
    for _ in range(200):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 12)))
                 for _ in range(rng.randint(1, 4))]
        text = "".join(rng.choice("ab") for _ in range(rng.randint(0, 60)))
        hits = [(text.find(s), len(s), s) for s in stops if s in text]
        expected = (text[:min(hits)[0]], min(hits)[2]) if hits else (text, None)
        m = StopStringMatcher(stops)
        pieces, matched, i = [], None, 0
        while i < len(text) and matched is None:
            step = rng.randint(1, 7)
            out, matched = m.feed(text[i:i + step])
            pieces.append(out)
            i += step
        if matched is None:
            pieces.append(m.flush())
            matched = m.matched
        assert ("".join(pieces), matched) == expected, (stops, text)
