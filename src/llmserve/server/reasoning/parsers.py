"""Reasoning parsers: a reasoning model's ``<think> ... </think>`` block split from its answer.

Two families, chosen per model (``--reasoning-parser``, or from the chat template):

* ``deepseek_r1``: the template opens the block itself (the generation prompt ends with
  ``<think>``), so the output starts inside it: everything up to ``</think>`` is reasoning
  (a leading ``<think>`` the model writes anyway is dropped). An output that never closes
  the block is all reasoning, as the model was cut short while thinking.
* ``qwen3``: the model opens the block itself; an output that does not start with
  ``<think>`` (thinking switched off) is all answer.

:class:`ReasoningStreamer` does the same split on a stream, holding back only text that may
still turn out to be a marker. Reasoning and answer text are exactly the output minus the
markers (and the whitespace right after ``</think>``). No torch.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

from llmserve.structured_output.reasoning_budget import ReasoningBudget

logger = logging.getLogger(__name__)

OPEN_THINK, CLOSE_THINK = "<think>", "</think>"

#: The parsers ``--reasoning-parser`` takes (``auto``: from the chat template; ``none``: off).
REASONING_PARSERS = ("auto", "none", "deepseek_r1", "qwen3")


@dataclass(frozen=True)
class ReasoningParser:
    """How one model family marks its reasoning (see the module docstring)."""

    name: str
    starts_inside: bool        # the generation prompt opened the block already

    def split(self, text: str) -> tuple[Optional[str], str]:
        """(reasoning or None, answer) of a whole output."""
        streamer = ReasoningStreamer(self)
        reasoning, answer = streamer.feed(text, final=True)
        return (reasoning if streamer.saw_reasoning else None), answer


PARSERS = {"deepseek_r1": ReasoningParser("deepseek_r1", starts_inside=True),
           "qwen3": ReasoningParser("qwen3", starts_inside=False)}


class MarkerEncoder(Protocol):
    """What a thinking budget needs of a tokenizer: the markers' token ids."""

    def encode(self, text: str, add_special_tokens: bool = True) -> Sequence[int]: ...


def thinking_budget(parser: ReasoningParser, tokenizer: MarkerEncoder,
                    max_tokens: int) -> ReasoningBudget:
    """The engine's :class:`ReasoningBudget` for ``parser``'s markers: at most
    ``max_tokens`` of reasoning, then ``</think>`` is forced."""
    end = tuple(tokenizer.encode(CLOSE_THINK, add_special_tokens=False))
    start = () if parser.starts_inside else \
        tuple(tokenizer.encode(OPEN_THINK, add_special_tokens=False))
    return ReasoningBudget(max_tokens, end, start)


def reasoning_parser(name: Optional[str], chat_template: Optional[str]) -> Optional[ReasoningParser]:
    """The parser ``name`` names; ``auto`` picks one from the chat template (None: the
    model does not reason, or ``none``). An unknown name is a ValueError."""
    if name in (None, "none"):
        return None
    if name != "auto":
        if name not in PARSERS:
            raise ValueError(f"unknown reasoning parser {name!r}; choose from "
                             f"{', '.join(REASONING_PARSERS)}")
        return PARSERS[name]
    template = chat_template or ""
    if CLOSE_THINK not in template and OPEN_THINK not in template:
        return None
    # a template whose generation prompt writes "<think>" opens the block for the model
    tail = template[template.rfind("add_generation_prompt"):] \
        if "add_generation_prompt" in template else ""
    return PARSERS["deepseek_r1" if OPEN_THINK in tail and "enable_thinking" not in tail
                   else "qwen3"]


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that begins ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class ReasoningStreamer:
    """Splits one output's text, piece by piece, into reasoning and answer deltas."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        # "start": nothing decided yet; "think": inside the block; "answer": after it
        self.state = "think" if parser.starts_inside else "start"
        self.buffer = ""
        self.saw_reasoning = parser.starts_inside
        self.strip_open = parser.starts_inside     # a redundant leading "<think>" is dropped
        self.strip_space = False                    # whitespace after "</think>" is dropped

    @property
    def in_reasoning(self) -> bool:
        """True while the output is inside the reasoning block."""
        return self.state in ("think", "start") and self.saw_reasoning

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, answer) to send after ``text``; ``final`` flushes what was held."""
        self.buffer += text
        reasoning: list[str] = []
        answer: list[str] = []
        while self.buffer:
            if self.state == "start" or self.strip_open:
                stripped = self.buffer.lstrip()
                if OPEN_THINK.startswith(stripped) and not final and len(stripped) < len(OPEN_THINK):
                    break                                   # may still become "<think>"
                self.strip_open = False
                if stripped.startswith(OPEN_THINK):
                    self.buffer = stripped[len(OPEN_THINK):]
                    self.state, self.saw_reasoning = "think", True
                elif self.state == "start":
                    self.state = "answer"
                continue
            if self.state == "think":
                end = self.buffer.find(CLOSE_THINK)
                if end < 0:
                    keep = 0 if final else _partial_suffix(self.buffer, CLOSE_THINK)
                    reasoning.append(self.buffer[:len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    break
                reasoning.append(self.buffer[:end])
                self.buffer = self.buffer[end + len(CLOSE_THINK):]
                self.state, self.strip_space = "answer", True
                continue
            if self.strip_space:
                self.buffer = self.buffer.lstrip()
                if not self.buffer:
                    break
                self.strip_space = False
            answer.append(self.buffer)
            self.buffer = ""
        return "".join(reasoning), "".join(answer)
