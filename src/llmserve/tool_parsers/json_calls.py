"""Incremental readers of tool calls written as JSON (Hermes, Llama-3 JSON, Mistral).

:class:`RawJsonValue` follows one JSON value character by character (strings, escapes and
nesting), so a region knows where ``arguments`` ends without waiting for the rest of the
text. :class:`JsonCallsRegion` reads call objects ``{"name": ..., "arguments": {...}}``
(``"parameters"`` is read too, as Llama 3 writes it): one object, an array of objects, or
objects separated by ``;``. The arguments of a call are its raw JSON text, streamed as it
arrives when it is an object or an array; a string holding JSON is sent as that JSON, any
other string or scalar as its JSON text, once complete. No torch.
"""
from __future__ import annotations

import json
from typing import Optional

from llmserve.tool_parsers.base import Event

_SPACE = " \t\r\n"
ARGUMENT_KEYS = ("arguments", "parameters")


def string_arguments(value: str) -> str:
    """The ``arguments`` text of arguments given as a JSON string: the string itself when
    it holds JSON, else the string as JSON."""
    try:
        json.loads(value)
        return value
    except json.JSONDecodeError:
        return json.dumps(value, ensure_ascii=False)


class RawJsonValue:
    """One JSON value read a character at a time; ``kind`` is ``container``, ``string`` or
    ``scalar`` from its first character."""

    def __init__(self, first: str) -> None:
        self.kind = "container" if first in "{[" else "string" if first == '"' else "scalar"
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.done = False
        self.chars: list[str] = []

    @property
    def text(self) -> str:
        return "".join(self.chars)

    def take(self, ch: str) -> bool:
        """Whether ``ch`` belongs to the value (``done`` is set by its last character, or,
        for a scalar, by the first character after it, which is not taken)."""
        if self.kind == "scalar":
            if ch in _SPACE or ch in ",}]":
                self.done = True
                return False
            self.chars.append(ch)
            return True
        self.chars.append(ch)
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
                self.done = self.kind == "string"
        elif ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            self.done = self.depth == 0
        return True


class JsonCallsRegion:
    """A region of JSON call objects (see the module docstring).

    ``arrays``: an array of objects is read too. ``separator``: objects may follow one
    another, separated by it (Llama 3's ``;``). ``end_marker``: the region closes with it
    (Hermes' ``</tool_call>``); a region that fails before it sent a call is content up to
    and with the marker, text after a sent call is dropped up to it. Without an end marker
    the region ends after its last object and the text after it is content again.
    """

    def __init__(self, opener: str, known: frozenset[str], *, arrays: bool = True,
                 separator: Optional[str] = None, end_marker: Optional[str] = None) -> None:
        self.text = opener
        self.i = len(opener)
        self.known = known
        self.arrays = arrays
        self.separator = separator
        self.end_marker = end_marker
        self.state = "top"
        self.in_array = False
        self.emitted = False
        self.events: list[Event] = []
        self.after_start = 0
        self.object_start = self.i
        self._new_object()

    def _new_object(self) -> None:
        self.key_chars: list[str] = []
        self.key = ""
        self.value: Optional[RawJsonValue] = None
        self.name: Optional[str] = None
        self.has_args = False
        self.args_held: list[str] = []     # arguments read before the name

    def _args(self, text: str) -> None:
        if self.name is None:
            self.args_held.append(text)
        elif self.events and self.events[-1][0] == "args":
            self.events[-1] = ("args", self.events[-1][1] + text)
        else:
            self.events.append(("args", text))

    # -- the character loop ------------------------------------------------------------

    def feed(self, text: str, final: bool) -> tuple[list[Event], Optional[str]]:
        self.text += text
        rest: Optional[str] = None
        while rest is None and self.i < len(self.text):
            rest = self._step(self.text[self.i])
        if rest is None and final:
            rest = self._finish()
        events, self.events = self.events, []
        return events, rest

    def _step(self, ch: str) -> Optional[str]:
        """Reads ``ch`` (advancing ``i`` unless another state must read it); the text
        after the region once it ended."""
        state = self.state
        if state == "value":
            return self._value_char(ch)
        if state == "after":
            return self._after_char(ch)
        if state in ("skip", "failed"):
            return self._skip_char()
        if ch in _SPACE and state != "key":
            self.i += 1
            return None
        if state == "top" or state == "item":
            if ch == "{":
                self.in_array = self.in_array or state == "item"
                self.object_start = self.i
                self.state = "key_or_end"
            elif ch == "[" and state == "top" and self.arrays:
                self.state = "item"
            else:
                return self._fail()
        elif state == "key_or_end" or state == "key_next":
            if ch == '"':
                self.state = "key"
            elif ch == "}" and state == "key_or_end":
                return self._end_object()
            else:
                return self._fail()
        elif state == "key":
            return self._key_char(ch)
        elif state == "colon":
            if ch != ":":
                return self._fail()
            self.state = "value_start"
        elif state == "value_start":
            self.value = RawJsonValue(ch)
            self.state = "value"
            return None           # the value reads ch
        elif state == "comma_or_end":
            if ch == ",":
                self.state = "key_next"
            elif ch == "}":
                return self._end_object()
            else:
                return self._fail()
        elif state == "item_next":
            if ch == ",":
                self.state = "item"
            elif ch == "]":
                self.i += 1
                return self._enter_after()
            else:
                return self._fail()
        self.i += 1
        return None

    def _key_char(self, ch: str) -> Optional[str]:
        self.i += 1
        chars = self.key_chars
        if ch == '"' and (not chars or chars[-1] != "\\" or _escaped_quote_ends(chars)):
            try:
                self.key = json.loads('"' + "".join(chars) + '"')
            except json.JSONDecodeError:
                self.i -= 1
                return self._fail()
            self.key_chars = []
            self.state = "colon"
        else:
            chars.append(ch)
        return None

    def _value_char(self, ch: str) -> Optional[str]:
        value = self.value
        if value is None:
            return self._fail()
        taken = value.take(ch)
        if taken:
            self.i += 1
            if value.kind == "container" and self._is_args_key() and not self.has_args:
                self._args(ch)
        if value.done:
            return self._end_value(value)
        return None

    def _is_args_key(self) -> bool:
        return self.key in ARGUMENT_KEYS

    def _end_value(self, value: RawJsonValue) -> Optional[str]:
        self.state = "comma_or_end"
        self.value = None
        if self._is_args_key():
            if self.has_args:
                return None
            self.has_args = True
            if value.kind == "string":
                self._args(string_arguments(json.loads(value.text)))
            elif value.kind == "scalar":
                self._args(value.text)
        elif self.key == "name" and self.name is None:
            name = json.loads(value.text) if value.kind == "string" else None
            if name not in self.known:
                return self._fail()
            self.name = name
            self.emitted = True
            self.events.append(("call", name))
            if self.args_held:
                self._args("".join(self.args_held))
                self.args_held = []
        return None

    def _end_object(self) -> Optional[str]:
        self.i += 1
        if self.name is None:
            self.i -= 1
            return self._fail()
        if not self.has_args:
            self._args("{}")
        self._new_object()
        self.object_start = self.i
        if self.in_array:
            self.state = "item_next"
            return None
        return self._enter_after()

    def _enter_after(self) -> Optional[str]:
        self.state = "after"
        self.after_start = self.i
        if self.separator is None and self.end_marker is None:
            return self.text[self.i:]
        return None

    def _after_char(self, ch: str) -> Optional[str]:
        tail = self.text[self.after_start:self.i + 1].lstrip()
        if self.separator is not None:
            if ch in _SPACE:
                self.i += 1
                return None
            if tail == self.separator:
                self.i += 1
                self.state, self.in_array = "top", False
                return None
            return self.text[self.after_start:]
        marker = self.end_marker or ""
        self.i += 1
        if tail == marker:
            return self.text[self.i:]
        if not marker.startswith(tail):
            self.state = "skip"
        return None

    def _skip_char(self) -> Optional[str]:
        """Junk after a sent call, or a failed block: up to the end marker."""
        marker = self.end_marker or ""
        at = self.text.find(marker, self.after_start)
        if at < 0:
            self.i = len(self.text)
            return None
        end = at + len(marker)
        if self.state == "failed":
            self.events.append(("content", self.text[:end]))
        return self.text[end:]

    def _fail(self) -> Optional[str]:
        if self.end_marker is not None:
            self.after_start = self.i
            self.state = "skip" if self.emitted else "failed"
            return None
        if not self.emitted:
            self.events.append(("content", self.text[:self.i]))
            return self.text[self.i:]
        return self.text[self.object_start:]   # the object that failed is content

    def _finish(self) -> str:
        """The text ended inside the region."""
        if self.state == "failed" or (not self.emitted and self.state != "after"):
            self.events.append(("content", self.text))
            return ""
        if self.state == "after":
            return self.text[self.after_start:] if self.separator is not None else ""
        if self.state == "value" and self.value is not None and self._is_args_key() \
                and self.value.kind == "scalar" and not self.has_args:
            self._args(self.value.text)   # a scalar ended by the end of the text
        return ""


def _escaped_quote_ends(chars: list[str]) -> bool:
    """Whether a quote after ``chars`` (which end with a backslash) closes the string:
    the backslashes before it pair up."""
    n = 0
    for c in reversed(chars):
        if c != "\\":
            break
        n += 1
    return n % 2 == 0
