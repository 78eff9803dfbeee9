"""Llama-3 JSON: ``<|python_tag|>`` or a bare JSON object that opens the answer::

    {"name": "get_weather", "parameters": {"city": "Paris"}}

several calls separated by ``;``; ``"arguments"`` is read as well as ``"parameters"``.
``<|python_tag|>`` is a special token, so the output keeps special tokens when this format
reads calls. No torch.
"""
from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

from llmserve.tool_parsers.base import MarkerToolParser, Region, Triggers, call_arguments
from llmserve.tool_parsers.hermes import calls_schema
from llmserve.tool_parsers.json_calls import JsonCallsRegion

PYTHON_TAG = "<|python_tag|>"
SEPARATOR = ";"


def llama3_region(opener: str, known: frozenset[str]) -> Region:
    """Call objects separated by ``;``."""
    return JsonCallsRegion(opener, known, arrays=False, separator=SEPARATOR)


class Llama3JsonParser(MarkerToolParser):
    """``{"name": ..., "parameters": {...}}`` (after ``<|python_tag|>`` or first)."""

    name = "llama3_json"
    call_format = (
        "To call a function, answer with only a JSON object, several separated by "
        "'; ':\n"
        '{"name": <function-name>, "parameters": <arguments-object>}')
    keeps_special_tokens = True
    triggers = Triggers(markers={PYTHON_TAG: llama3_region}, first_chars={"{": llama3_region})

    def forcing_grammar(self, tools: Sequence[Mapping[str, Any]], parallel: bool,
                        json_options: Mapping[str, Any]) -> str:
        more = ' ("; " call)*' if parallel else ""
        return (f"start: call{more}\n"
                f"call: %json {calls_schema(tools, json_options, 'parameters')}")

    def render_calls(self, calls: Sequence[Mapping[str, Any]]) -> str:
        return f"{SEPARATOR} ".join(
            json.dumps({"name": c["function"]["name"], "parameters": call_arguments(c)},
                       ensure_ascii=False) for c in calls)
