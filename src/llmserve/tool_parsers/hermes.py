"""Hermes: ``<tool_call>`` blocks of JSON, the format of Qwen 2.5 / NousHermes and the one
llmserve describes to models whose template has no tool support (the default SmolLM2)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

One block per call; a JSON array of calls inside one block is read too. No torch.
"""
from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

from llmserve.tool_parsers.base import MarkerToolParser, Region, Triggers, call_arguments
from llmserve.tool_parsers.json_calls import JsonCallsRegion

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def hermes_region(opener: str, known: frozenset[str]) -> Region:
    """The JSON of one ``<tool_call>`` block (an object or an array of them)."""
    return JsonCallsRegion(opener, known, arrays=True, end_marker=CLOSE)


def call_schema(tool: Mapping[str, Any], args_key: str = "arguments") -> dict[str, Any]:
    """The JSON schema of ``{"name": <the tool's>, <args_key>: <its parameters>}``."""
    fn = tool["function"]
    return {"type": "object", "properties": {"name": {"const": fn["name"]},
                                             args_key: fn["parameters"]},
            "required": ["name", args_key], "additionalProperties": False}


def calls_schema(tools: Sequence[Mapping[str, Any]], json_options: Mapping[str, Any],
                 args_key: str = "arguments") -> str:
    """One call of any of ``tools`` as a ``%json`` schema (the JSON text)."""
    schema: dict[str, Any] = call_schema(tools[0], args_key) if len(tools) == 1 else {
        "anyOf": [call_schema(t, args_key) for t in tools]}
    schema["x-guidance"] = dict(json_options)
    return json.dumps(schema)


def hermes_grammar(tools: Sequence[Mapping[str, Any]], parallel: bool,
                   json_options: Mapping[str, Any]) -> str:
    """``<tool_call>`` blocks, one per line (one block without ``parallel``)."""
    block = f'"{OPEN}\\n" call "\\n{CLOSE}"'
    more = ' ("\\n" block)*' if parallel else ""
    return f"start: block{more}\nblock: {block}\ncall: %json {calls_schema(tools, json_options)}"


class HermesForcing:
    """Forced calls (``tool_choice`` required or named) as Hermes blocks: for Hermes, and
    for formats a grammar writes awkwardly, whose parsers read Hermes blocks too."""

    def forcing_grammar(self, tools: Sequence[Mapping[str, Any]], parallel: bool,
                        json_options: Mapping[str, Any]) -> str:
        return hermes_grammar(tools, parallel, json_options)


class HermesParser(HermesForcing, MarkerToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``."""

    name = "hermes"
    call_format = (
        "To call a function, answer with one block per call:\n"
        f'{OPEN}\n{{"name": <function-name>, "arguments": <arguments-object>}}\n{CLOSE}')
    triggers = Triggers(markers={OPEN: hermes_region}, first_chars={})

    def render_calls(self, calls: Sequence[Mapping[str, Any]]) -> str:
        return "\n".join(
            f"{OPEN}\n" + json.dumps({"name": c["function"]["name"],
                                      "arguments": call_arguments(c)},
                                     ensure_ascii=False) + f"\n{CLOSE}" for c in calls)
