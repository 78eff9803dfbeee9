"""Qwen3-Coder: XML-style calls inside ``<tool_call>``::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A value is converted by its parameter's schema type: a ``string`` parameter (or one the
schema does not name) keeps the text, and streams as it arrives; any other type is read
as JSON (or a Python literal), falling back to the text, once the parameter closes. One
newline after ``<parameter=...>`` and one before ``</parameter>`` are not part of the
value. ``arguments`` is ``json.dumps`` of the values. A JSON body inside ``<tool_call>``
(Hermes) is read too: ``tool_choice`` required / named forces that (a grammar per schema
type for the XML form is not worth it). No torch.
"""
from __future__ import annotations

import ast
import json
from typing import Any, Mapping, Optional, Sequence

from llmserve.tool_parsers.base import (
    CallStreamer,
    Event,
    MarkerToolParser,
    Region,
    Triggers,
    call_arguments,
    partial_suffix,
)
from llmserve.tool_parsers.hermes import CLOSE, OPEN, HermesForcing
from llmserve.tool_parsers.json_calls import JsonCallsRegion
from llmserve.tool_parsers.pythonic import json_value

FUNCTION, END_FUNCTION = "<function=", "</function>"
PARAMETER, END_PARAMETER = "<parameter=", "</parameter>"
_VALUE_END = "\n" + END_PARAMETER
_SPACE = " \t\r\n"


def is_text_parameter(schema: Any) -> bool:
    """Whether a parameter's value stays text: its schema type is ``string`` (or none)."""
    kind = schema.get("type") if isinstance(schema, Mapping) else None
    if isinstance(kind, list):
        kind = kind[0] if len(kind) == 1 else None
    return kind in ("string", None) and not (isinstance(schema, Mapping) and (
        "enum" in schema and not all(isinstance(v, str) for v in schema["enum"])))


def converted(text: str) -> Any:
    """A non-string parameter's value: JSON, else a Python literal, else the text."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    try:
        return json_value(ast.literal_eval(text.strip()))
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return text


def _escaped(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)[1:-1]


class Qwen3CoderRegion:
    """One ``<tool_call>`` block (see the module docstring)."""

    def __init__(self, opener: str, known: frozenset[str],
                 params: Mapping[str, Mapping[str, Any]]) -> None:
        self.text = opener
        self.i = len(opener)
        self.known = known
        self.params = params             # tool name -> its parameter schemas
        self.state = "start"             # start | params | value | between | skip
        self.waiting = False             # the state needs more text
        self.emitted = False
        self.inner: Optional[Region] = None
        self.function = ""
        self.key = ""
        self.num_args = 0
        self.value_start = 0             # where the value's text begins
        self.lead_read = False           # the newline after <parameter=...> was looked at
        self.sent = 0                    # text value: sent up to here
        self.text_value = False

    def feed(self, text: str, final: bool) -> tuple[list[Event], Optional[str]]:
        if self.inner is not None:
            return self.inner.feed(text, final)
        self.text += text
        events: list[Event] = []
        self.waiting = False
        while not self.waiting:
            if self.state == "json":     # a Hermes JSON body
                self.inner = JsonCallsRegion(self.text[:self.i], self.known, arrays=True,
                                             end_marker=CLOSE)
                got, rest = self.inner.feed(self.text[self.i:], final)
                return events + got, rest
            rest = self._step(events)
            if rest is not None:
                return events, rest
        if not final:
            return events, None
        if self.emitted:
            return events, ""
        return [("content", self.text)], ""

    def _step(self, events: list[Event]) -> Optional[str]:
        """Advances one state (or sets ``waiting``); the text after the region once it
        ended."""
        if self.state == "value":
            return self._value(events)
        if self.state == "skip":
            return self._skip(events)
        t, j = self.text, self.i
        while j < len(t) and t[j] in _SPACE:
            j += 1
        if j == len(t):
            self.waiting = True
            return None
        if self.state == "start" and t[j] in "{[":
            self.i, self.state = j, "json"
            return None
        tags = {"start": (FUNCTION,), "params": (PARAMETER, END_FUNCTION),
                "between": (FUNCTION, CLOSE)}[self.state]
        for tag in tags:
            if t.startswith(tag, j):
                return self._tag(tag, j + len(tag), events)
            if tag.startswith(t[j:]):
                self.waiting = True
                return None
        self.state = "skip"
        return None

    def _tag(self, tag: str, end: int, events: list[Event]) -> Optional[str]:
        t = self.text
        if tag == CLOSE:
            return t[end:]
        if tag == END_FUNCTION:
            events.append(("args", "}" if self.num_args else "{}"))
            self.i, self.state = end, "between"
            return None
        close = t.find(">", end)
        if close < 0:
            self.waiting = True
            return None
        word = t[end:close]
        if tag == FUNCTION:
            if word not in self.known:
                self.state = "skip"
                return None
            self.function, self.num_args, self.emitted = word, 0, True
            events.append(("call", word))
            self.i, self.state = close + 1, "params"
            return None
        self.text_value = is_text_parameter(self.params.get(self.function, {}).get(word))
        self.key = json.dumps(word, ensure_ascii=False)
        self.value_start = self.sent = close + 1
        self.lead_read = False
        if self.text_value:
            events.append(("args", self._lead() + '"'))
        self.i, self.state = close + 1, "value"
        return None

    def _lead(self) -> str:
        lead = ("{" if not self.num_args else ", ") + self.key + ": "
        self.num_args += 1
        return lead

    def _value(self, events: list[Event]) -> Optional[str]:
        t = self.text
        if not self.lead_read:                    # one newline after the tag is not text
            if len(t) == self.value_start:
                self.waiting = True
                return None
            self.lead_read = True
            if t[self.value_start] == "\n":
                self.value_start = self.sent = self.value_start + 1
        end = t.find(END_PARAMETER, max(self.value_start, self.sent - len(END_PARAMETER)))
        if end < 0:
            if self.text_value:
                tail = t[self.sent:]
                safe = len(t) - max(partial_suffix(tail, _VALUE_END),
                                    partial_suffix(tail, END_PARAMETER))
                if safe > self.sent:
                    events.append(("args", _escaped(t[self.sent:safe])))
                    self.sent = safe
            self.waiting = True
            return None
        stop = end - 1 if end > self.value_start and t[end - 1] == "\n" else end
        if self.text_value:
            events.append(("args", _escaped(t[self.sent:stop]) + '"'))
        else:
            events.append(("args", self._lead() + json.dumps(
                converted(t[self.value_start:stop]), ensure_ascii=False)))
        self.i, self.state = end + len(END_PARAMETER), "params"
        return None

    def _skip(self, events: list[Event]) -> Optional[str]:
        """A failed block (content) or junk after a sent call (dropped), up to the end."""
        at = self.text.find(CLOSE, self.i)
        if at < 0:
            self.waiting = True
            return None
        if not self.emitted:
            events.append(("content", self.text[:at + len(CLOSE)]))
        return self.text[at + len(CLOSE):]


class Qwen3CoderParser(HermesForcing, MarkerToolParser):
    """``<tool_call><function=NAME><parameter=P>VALUE</parameter></function></tool_call>``."""

    name = "qwen3_coder"
    call_format = (
        "To call a function, answer with one block per call:\n"
        f"{OPEN}\n{FUNCTION}function-name>\n{PARAMETER}parameter-name>\nvalue\n"
        f"{END_PARAMETER}\n{END_FUNCTION}\n{CLOSE}")

    def streamer(self, tools: Sequence[Mapping[str, Any]]) -> CallStreamer:
        params = {t["function"]["name"]: dict(
            (t["function"].get("parameters") or {}).get("properties") or {}) for t in tools}

        def region(opener: str, known: frozenset[str]) -> Region:
            return Qwen3CoderRegion(opener, known, params)

        return CallStreamer(Triggers(markers={OPEN: region}, first_chars={}), tools)

    def render_calls(self, calls: Sequence[Mapping[str, Any]]) -> str:
        blocks = []
        for c in calls:
            args = call_arguments(c)
            params = "".join(
                f"{PARAMETER}{k}>\n{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}"
                f"\n{END_PARAMETER}\n" for k, v in (args.items() if isinstance(args, dict) else ()))
            blocks.append(f"{OPEN}\n{FUNCTION}{c['function']['name']}>\n{params}"
                          f"{END_FUNCTION}\n{CLOSE}")
        return "\n".join(blocks)
