"""The seams every tool-call format plugs into, and the one streamer they share (no torch).

A format is a :class:`ToolParser`. Its output side is a set of *triggers*: marker strings
(``<tool_call>``, ``[TOOL_CALLS]`` ...) that open a call region anywhere in the text, and
characters (``{`` for Llama-3 JSON, ``[`` for pythonic) that open one when they are the
first thing the model writes. A region (:class:`Region`) reads the calls in its text
incrementally and reports :data:`Event` s: ``("call", name)`` when a call's name is known,
``("args", text)`` for each piece of its ``arguments`` JSON text, and ``("content", text)``
for text that turned out not to be a call.

:class:`CallStreamer` drives the regions over the streamed text and turns the events into
OpenAI chat deltas; :meth:`MarkerToolParser.parse` runs the same streamer over a whole
text at once, so a non-streamed answer and the concatenated stream agree exactly, however
the text was cut. What the streamer sends is never taken back: a region that fails after
it sent a call (malformed text later in the block, output cut short) leaves that call as
sent, and the non-streamed answer has the same call.

Content policy: text that may still become a marker is held back; before the first call
content goes out as it comes; after a call, whitespace is held until text follows it (a
call or the end drops it).
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Protocol, Sequence

#: ``("content", text)``, ``("call", name)`` or ``("args", text)``.
Event = tuple[str, str]


def new_call_id() -> str:
    """A fresh OpenAI-style tool call id."""
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class ToolCall:
    """One parsed call: ``arguments`` is the JSON text sent to the client."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


class Region(Protocol):
    """The incremental reader of one call region (opened by a trigger)."""

    def feed(self, text: str, final: bool) -> tuple[list[Event], Optional[str]]:
        """The events ``text`` completes, and the text after the region once it has ended
        (None while it is open). With ``final`` the region must end."""


#: Makes a region: (the trigger text that opened it, the names of the tools).
RegionFactory = Callable[[str, frozenset[str]], Region]


class ToolCallDeltaStream(Protocol):
    """One streamed choice's splitter: text in, (content, tool-call deltas) out."""

    num_calls: int

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """(content to send now, OpenAI tool-call deltas to send now) after ``text``;
        ``final`` flushes what was held back."""


class ToolParser(Protocol):
    """One model family's tool-call format: the output side (parse, stream), the forcing
    grammar of ``tool_choice`` required / named, and the prompt side for templates that
    cannot render tools themselves."""

    name: str
    #: The markers are special tokens: the output must be detokenized with them.
    keeps_special_tokens: bool

    def streamer(self, tools: Sequence[Mapping[str, Any]]) -> ToolCallDeltaStream:
        """A splitter for one streamed choice."""

    def parse(self, text: str, tools: Sequence[Mapping[str, Any]]
              ) -> tuple[Optional[str], list[ToolCall]]:
        """(content left, calls); the text itself and no calls when nothing parses."""

    def forcing_grammar(self, tools: Sequence[Mapping[str, Any]], parallel: bool,
                        json_options: Mapping[str, Any]) -> str:
        """A lark grammar (with ``%json``) whose every string is one call of ``tools``
        (several with ``parallel``) that :meth:`parse` reads; ``json_options`` is the
        ``x-guidance`` object of the JSON parts."""

    def describe_tools(self, tools: Sequence[Mapping[str, Any]]) -> str:
        """The system-message text that lists the tools and this format."""

    def render_calls(self, calls: Sequence[Mapping[str, Any]]) -> str:
        """An assistant turn's OpenAI ``tool_calls`` written in this format."""


def tool_names(tools: Sequence[Mapping[str, Any]]) -> frozenset[str]:
    return frozenset(t["function"]["name"] for t in tools)


def loads_or_text(text: Any) -> Any:
    """``text`` parsed as JSON, or as it is when it is not JSON (or not a string)."""
    if not isinstance(text, str):
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def call_arguments(call: Mapping[str, Any]) -> Any:
    """An OpenAI tool call's arguments as a value (the text when it is not JSON)."""
    return loads_or_text(call["function"].get("arguments", "{}"))


def tools_listing(tools: Sequence[Mapping[str, Any]]) -> str:
    """The tools, one JSON object a line, inside ``<tools></tools>``."""
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return f"<tools>\n{listing}\n</tools>"


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that begins ``marker`` (but is not all of it)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


@dataclass(frozen=True)
class Triggers:
    """What opens a region: marker strings anywhere, characters first in the output."""

    markers: Mapping[str, RegionFactory]
    first_chars: Mapping[str, RegionFactory]


class CallStreamer:
    """The :class:`ToolCallDeltaStream` of a :class:`MarkerToolParser` (see the module
    docstring)."""

    def __init__(self, triggers: Triggers, tools: Sequence[Mapping[str, Any]]) -> None:
        self.triggers = triggers
        self.known = tool_names(tools)
        self.pending = ""
        self.region: Optional[Region] = None
        self.at_start = bool(triggers.first_chars)   # nothing but whitespace seen yet
        self.num_calls = 0
        self.held_space = ""            # whitespace after a call, sent once text follows

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        content: list[str] = []
        deltas: list[dict[str, Any]] = []
        for kind, value in self._events(text, final):
            if kind == "content":
                content.append(self._content(value))
            elif kind == "call":
                self.held_space = ""
                self.num_calls += 1
                deltas.append({"index": self.num_calls - 1, "id": new_call_id(),
                               "type": "function",
                               "function": {"name": value, "arguments": ""}})
            elif value:
                last = deltas[-1] if deltas else None
                if last is not None and "id" not in last:   # one delta per call per feed
                    last["function"]["arguments"] += value
                else:
                    deltas.append({"index": self.num_calls - 1,
                                   "function": {"arguments": value}})
        if final:
            self.held_space = ""
        return "".join(content), deltas

    def _content(self, text: str) -> str:
        if not self.num_calls:
            return text
        text = self.held_space + text
        body = text.rstrip()
        self.held_space = text[len(body):]
        return body

    def _events(self, text: str, final: bool) -> list[Event]:
        self.pending += text
        events: list[Event] = []
        while True:
            if self.region is not None:
                got, rest = self.region.feed(self.pending, final)
                self.pending = ""
                events += got
                if rest is None:
                    return events
                self.region, self.pending = None, rest
                continue
            if self.at_start:
                body = self.pending.lstrip()
                if not body:
                    if final:
                        events.append(("content", self.pending))
                        self.pending = ""
                    return events
                self.at_start = False
                factory = self.triggers.first_chars.get(body[0])
                if factory is not None:
                    self.region = factory(self.pending[:len(self.pending) - len(body)],
                                          self.known)
                    self.pending = body
                    continue
            found = self._first_marker()
            if found is not None:
                at, marker = found
                events.append(("content", self.pending[:at]))
                self.region = self.triggers.markers[marker](marker, self.known)
                self.pending = self.pending[at + len(marker):]
                continue
            keep = 0 if final else max((partial_suffix(self.pending, m)
                                        for m in self.triggers.markers), default=0)
            events.append(("content", self.pending[:len(self.pending) - keep]))
            self.pending = self.pending[len(self.pending) - keep:]
            return events

    def _first_marker(self) -> Optional[tuple[int, str]]:
        best: Optional[tuple[int, str]] = None
        for marker in self.triggers.markers:
            at = self.pending.find(marker)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, marker)
        return best


class MarkerToolParser:
    """A :class:`ToolParser` whose output side is :class:`Triggers` (subclasses give
    ``name``, ``triggers`` and the grammar and prompt methods)."""

    name = ""
    keeps_special_tokens = False
    #: How a model whose template has no tool support is told to call (after the listing).
    call_format = ""
    triggers: Triggers

    def describe_tools(self, tools: Sequence[Mapping[str, Any]]) -> str:
        return ("You can call functions. Their signatures are listed in <tools></tools>:\n"
                f"{tools_listing(tools)}\n{self.call_format}")

    def streamer(self, tools: Sequence[Mapping[str, Any]]) -> CallStreamer:
        return CallStreamer(self.triggers, tools)

    def parse(self, text: str, tools: Sequence[Mapping[str, Any]]
              ) -> tuple[Optional[str], list[ToolCall]]:
        content, deltas = self.streamer(tools).feed(text, final=True)
        calls = assemble_calls(deltas)
        if not calls:
            return text, []
        return content.strip() or None, calls


def assemble_calls(deltas: Sequence[Mapping[str, Any]]) -> list[ToolCall]:
    """The calls a sequence of streamed tool-call deltas adds up to."""
    calls: list[ToolCall] = []
    for d in deltas:
        fn = d["function"]
        if "id" in d:
            calls.append(ToolCall(d["id"], fn["name"], fn.get("arguments", "")))
        else:
            calls[d["index"]].arguments += fn["arguments"]
    return calls


