"""Mistral: ``[TOOL_CALLS]`` and a JSON array of calls::

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]

and the newer form, one ``[TOOL_CALLS]`` per call: ``[TOOL_CALLS]get_weather[ARGS]{"city":
"Paris"}``. ``[TOOL_CALLS]`` is a special token, so the output keeps special tokens when
this format reads calls. No torch.
"""
from __future__ import annotations

import json
import re
from typing import Any, Mapping, Optional, Sequence

from llmserve.tool_parsers.base import Event, MarkerToolParser, Region, Triggers, call_arguments
from llmserve.tool_parsers.hermes import calls_schema
from llmserve.tool_parsers.json_calls import JsonCallsRegion, RawJsonValue

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
_NAME_CHARS = re.compile(r"[A-Za-z0-9_.\-]*")


class MistralRegion:
    """After ``[TOOL_CALLS]``: a JSON array (or object) of calls, or ``name[ARGS]{...}``."""

    def __init__(self, opener: str, known: frozenset[str]) -> None:
        self.opener = opener
        self.known = known
        self.text = ""
        self.inner: Optional[Region] = None
        self.args: Optional[RawJsonValue] = None
        self.i = 0

    def feed(self, text: str, final: bool) -> tuple[list[Event], Optional[str]]:
        if self.inner is not None:
            return self.inner.feed(text, final)
        self.text += text
        if self.args is not None:
            return self._args(final)
        body = self.text.lstrip()
        if not body:
            return self._undecided(final)
        if body[0] in "[{":
            self.inner = JsonCallsRegion(self.opener + self.text[:len(self.text) - len(body)],
                                         self.known, arrays=True)
            return self.inner.feed(body, final)
        match = _NAME_CHARS.match(body)
        head = match.group(0) if match else ""
        after = body[len(head):]
        if after.startswith(ARGS):
            after = after[len(ARGS):]
        elif ARGS.startswith(after):      # "[ARGS]" may still come (or nothing yet)
            return self._undecided(final)
        args = after.lstrip()
        if not args:
            return self._undecided(final)
        if not head or head not in self.known or args[0] != "{":
            return [("content", self.opener)], self.text
        self.i = len(self.text) - len(args)
        self.args = RawJsonValue("{")
        got, rest = self._args(final)
        return [("call", head), *got], rest

    def _undecided(self, final: bool) -> tuple[list[Event], Optional[str]]:
        if final:
            return [("content", self.opener)], self.text
        return [], None

    def _args(self, final: bool) -> tuple[list[Event], Optional[str]]:
        value = self.args
        if value is None:
            return [], ""
        start = self.i
        while self.i < len(self.text) and not value.done and value.take(self.text[self.i]):
            self.i += 1
        piece = self.text[start:self.i]
        events: list[Event] = [("args", piece)] if piece else []
        if value.done:
            return events, self.text[self.i:]
        return events, ("" if final else None)


def mistral_region(opener: str, known: frozenset[str]) -> Region:
    return MistralRegion(opener, known)


class MistralParser(MarkerToolParser):
    """``[TOOL_CALLS][{"name": ..., "arguments": {...}}]`` or ``[TOOL_CALLS]name[ARGS]{...}``."""

    name = "mistral"
    call_format = (
        f"To call functions, answer with {TOOL_CALLS} and a JSON array of calls:\n"
        f'{TOOL_CALLS}[{{"name": <function-name>, "arguments": <arguments-object>}}]')
    keeps_special_tokens = True
    triggers = Triggers(markers={TOOL_CALLS: mistral_region}, first_chars={})

    def forcing_grammar(self, tools: Sequence[Mapping[str, Any]], parallel: bool,
                        json_options: Mapping[str, Any]) -> str:
        more = ' (", " call)*' if parallel else ""
        return (f'start: "{TOOL_CALLS}[" call{more} "]"\n'
                f"call: %json {calls_schema(tools, json_options)}")

    def render_calls(self, calls: Sequence[Mapping[str, Any]]) -> str:
        return TOOL_CALLS + json.dumps(
            [{"name": c["function"]["name"], "arguments": call_arguments(c)} for c in calls],
            ensure_ascii=False)
