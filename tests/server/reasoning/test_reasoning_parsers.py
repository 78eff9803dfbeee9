"""Reasoning parsers: the think block split from the answer, whole and streamed in any pieces."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmserve.server.reasoning.parsers import (
    PARSERS,
    ReasoningStreamer,
    reasoning_parser,
)

R1, QWEN3 = PARSERS["deepseek_r1"], PARSERS["qwen3"]


@pytest.mark.parametrize("parser,text,expected", [
    (R1, "Let me see.</think>\n\nIt is 5.", ("Let me see.", "It is 5.")),
    (R1, "<think>\nhmm</think>Yes", ("\nhmm", "Yes")),
    (R1, "still thinking when cut", ("still thinking when cut", "")),
    (R1, "</think>Direct.", ("", "Direct.")),
    (QWEN3, "<think>\nWhy?\n</think>\n\nBecause.", ("\nWhy?\n", "Because.")),
    (QWEN3, "No thinking here.", (None, "No thinking here.")),
    (QWEN3, "  <think>a</think>b", ("a", "b")),
    (QWEN3, "a <think> in the middle</think> stays", (None, "a <think> in the middle</think> stays")),
])
def test_split(parser, text, expected):
    assert parser.split(text) == expected


def test_auto_detection_from_the_template():
    r1 = "{% if add_generation_prompt %}<|Assistant|><think>\n{% endif %}"
    qwen3 = ("{%- if add_generation_prompt %}<|im_start|>assistant\n{%- if enable_thinking "
             "is defined and enable_thinking is false %}<think>\n\n</think>\n\n{%- endif %}"
             "{%- endif %}{{ '</think>' }}")
    assert reasoning_parser("auto", r1) is R1
    assert reasoning_parser("auto", qwen3) is QWEN3
    assert reasoning_parser("auto", "{{ messages }}") is None
    assert reasoning_parser("none", r1) is None
    assert reasoning_parser("qwen3", None) is QWEN3
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        reasoning_parser("o1", None)


def _pieces(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in zip(points, points[1:])]


_TEXT = st.text(alphabet=st.sampled_from(list("ab <>/thinkTHINK\n")), max_size=30)


@settings(max_examples=300, deadline=None)
@given(reasoning=_TEXT, answer=_TEXT, opened=st.booleans(), closed=st.booleans(),
       cuts=st.lists(st.integers(0, 200), max_size=12), qwen=st.booleans())
def test_streamed_pieces_reassemble_to_the_whole_split(reasoning, answer, opened, closed,
                                                       cuts, qwen):
    parser = QWEN3 if qwen else R1
    text = ("<think>" if opened else "") + reasoning + ("</think>" + answer if closed else "")
    whole_reasoning, whole_answer = parser.split(text)
    streamer = ReasoningStreamer(parser)
    got_r, got_a = [], []
    pieces = _pieces(text, cuts)
    for i, piece in enumerate(pieces):
        r, a = streamer.feed(piece, final=i == len(pieces) - 1)
        got_r.append(r)
        got_a.append(a)
    if not pieces:
        r, a = streamer.feed("", final=True)
        got_r.append(r)
        got_a.append(a)
    assert "".join(got_r) == (whole_reasoning or "")
    assert "".join(got_a) == whole_answer
