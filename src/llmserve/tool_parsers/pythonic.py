"""Pythonic: a Python list of calls that opens the answer (Llama 3.2 / Llama 4 style)::

    [get_weather(city="Paris", unit="celsius"), get_time()]

Keyword arguments only, each value a Python literal (read with :func:`ast.literal_eval`;
tuples become lists). A call's ``arguments`` JSON grows one argument at a time, as each
value completes. ``tool_choice`` required / named forces Hermes ``<tool_call>`` blocks
(a grammar for Python literals of a JSON schema is out of reach), which this format reads
too. No torch.
"""
from __future__ import annotations

import ast
import json
import math
from typing import Any, Mapping, Optional, Sequence

from llmserve.tool_parsers.base import Event, MarkerToolParser, Region, Triggers, call_arguments
from llmserve.tool_parsers.hermes import OPEN, HermesForcing, hermes_region

_SPACE = " \t\r\n"


def _is_ident(ch: str) -> bool:
    return ch.isalnum() or ch in "_."


def json_value(value: Any) -> Any:
    """A Python literal as a JSON value (tuples as lists); ValueError when it has none."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("not a finite number")
        return value
    if isinstance(value, (list, tuple)):
        return [json_value(v) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: json_value(v) for k, v in value.items()}
    raise ValueError(f"not a JSON value: {type(value).__name__}")


def python_literal(value: Any) -> str:
    """A JSON value written as a Python literal."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{python_literal(k)}: {python_literal(v)}"
                               for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(python_literal(v) for v in value) + "]"
    return repr(value)


class PythonicRegion:
    """``[name(key=literal, ...), ...]`` read a character at a time."""

    def __init__(self, opener: str, known: frozenset[str]) -> None:
        self.text = opener
        self.i = len(opener)
        self.known = known
        self.state = "open"
        self.emitted = False
        self.word: list[str] = []
        self.num_args = 0
        self.value: list[str] = []
        self.depth = 0
        self.quote = ""
        self.escaped = False

    def feed(self, text: str, final: bool) -> tuple[list[Event], Optional[str]]:
        self.text += text
        events: list[Event] = []
        while self.i < len(self.text):
            rest = self._step(self.text[self.i], events)
            if rest is not None:
                return events, rest
        if final:
            if not self.emitted:
                return [("content", self.text)], ""
            return events, ""
        return events, None

    def _fail(self, events: list[Event]) -> str:
        if not self.emitted:
            events.append(("content", self.text[:self.i]))
        return self.text[self.i:]

    def _step(self, ch: str, events: list[Event]) -> Optional[str]:
        state = self.state
        if state == "value":
            return self._value_char(ch, events)
        if state in ("name", "key") and _is_ident(ch):
            self.word.append(ch)
        elif ch in _SPACE:
            if state in ("name", "key") and self.word:
                self.state += "_done"
        elif state == "open":
            if ch != "[":
                return self._fail(events)
            self.state = "call"
        elif state == "call" and _is_ident(ch) and not ch.isdigit():
            self.word, self.state = [ch], "name"
        elif state in ("name", "name_done") and ch == "(" and self.word:
            name = "".join(self.word)
            if name not in self.known:
                return self._fail(events)
            self.emitted = True
            events.append(("call", name))
            self.num_args, self.state = 0, "args"
        elif state == "args" and ch == ")":
            events.append(("args", "}" if self.num_args else "{}"))
            self.state = "next"
        elif state == "args" and _is_ident(ch) and not ch.isdigit():
            self.word, self.state = [ch], "key"
        elif state in ("key", "key_done") and ch == "=":
            self.value, self.depth, self.quote, self.state = [], 0, "", "value"
        elif state == "next" and ch == ",":
            self.state = "call"
        elif state == "next" and ch == "]":
            self.i += 1
            return self.text[self.i:]
        else:
            return self._fail(events)
        self.i += 1
        return None

    def _value_char(self, ch: str, events: list[Event]) -> Optional[str]:
        if self.quote:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == self.quote:
                self.quote = ""
        elif ch in "'\"":
            self.quote = ch
        elif ch in "([{":
            self.depth += 1
        elif ch in ")]}" and self.depth:
            self.depth -= 1
        elif ch in ",)" and not self.depth:
            try:
                value = json_value(ast.literal_eval("".join(self.value).strip()))
            except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                return self._fail(events)
            key = json.dumps("".join(self.word), ensure_ascii=False)
            events.append(("args", ("{" if not self.num_args else ", ") + key + ": "
                           + json.dumps(value, ensure_ascii=False)))
            self.num_args += 1
            self.state = "args"
            if ch == ")":
                return None      # "args" reads the ")"
            self.i += 1
            return None
        self.value.append(ch)
        self.i += 1
        return None


def pythonic_region(opener: str, known: frozenset[str]) -> Region:
    return PythonicRegion(opener, known)


class PythonicParser(HermesForcing, MarkerToolParser):
    """``[fn(a=1, b="x"), g()]`` first in the answer (and Hermes blocks)."""

    name = "pythonic"
    call_format = (
        "To call functions, answer with only a Python list of calls with keyword "
        "arguments:\n[func_name1(param1=value1, param2=value2), func_name2()]")
    triggers = Triggers(markers={OPEN: hermes_region}, first_chars={"[": pythonic_region})

    def render_calls(self, calls: Sequence[Mapping[str, Any]]) -> str:
        parts = []
        for c in calls:
            args = call_arguments(c)
            kwargs = ", ".join(f"{k}={python_literal(v)}" for k, v in args.items()) \
                if isinstance(args, dict) else ""
            parts.append(f"{c['function']['name']}({kwargs})")
        return "[" + ", ".join(parts) + "]"
