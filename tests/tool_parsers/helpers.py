"""Shared helpers of the tool-parser tests: feed a text in pieces, render calls per family."""
from __future__ import annotations

import json
from typing import Any, Iterable, Optional

from llmserve.tool_parsers import ToolParser
from llmserve.tool_parsers.base import ToolCall, assemble_calls
from llmserve.tool_parsers.pythonic import python_literal


def stream(parser: ToolParser, tools: list[dict], pieces: Iterable[str]
           ) -> tuple[str, list[ToolCall], dict[int, list[str]]]:
    """(content sent, calls the deltas add up to, each call's argument deltas)."""
    s = parser.streamer(tools)
    content, deltas = [], []
    for piece in list(pieces) + [None]:
        text, got = s.feed(piece or "", final=piece is None)
        content.append(text)
        deltas += got
    args: dict[int, list[str]] = {}
    for d in deltas:
        if "id" in d:
            assert d["type"] == "function" and d["function"]["arguments"] == ""
            assert d["id"].startswith("call_") and d["function"]["name"]
            args[d["index"]] = []
        else:
            assert set(d) == {"index", "function"} and d["function"]["arguments"]
            args[d["index"]].append(d["function"]["arguments"])
    return "".join(content), assemble_calls(deltas), args


def cut(text: str, points: Iterable[int]) -> list[str]:
    """``text`` cut at ``points``."""
    edges = [0, *sorted({p for p in points if 0 < p < len(text)}), len(text)]
    return [text[a:b] for a, b in zip(edges, edges[1:])]


def tool(name: str, properties: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": properties or {}}}}


def json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    return {float: "number", str: "string", type(None): "null", list: "array",
            dict: "object"}[type(value)]


def render(family: str, calls: list[tuple[str, dict]], prefix: str = "", *,
           variant: int = 0) -> str:
    """``calls`` written as the model family writes them, after ``prefix`` content (the
    formats that must open the answer put ``prefix`` only where a marker allows it)."""
    ascii_ = variant % 2 == 1
    if family == "hermes":
        if variant == 2 and calls:   # one block holding an array
            return prefix + "<tool_call>\n" + json.dumps(
                [{"name": n, "arguments": a} for n, a in calls]) + "\n</tool_call>"
        return prefix + "\n".join(
            "<tool_call>\n" + json.dumps({"name": n, "arguments": a}, ensure_ascii=ascii_)
            + "\n</tool_call>" for n, a in calls)
    if family == "llama3_json":
        body = "; ".join(json.dumps({"name": n, "parameters": a}, ensure_ascii=ascii_)
                         for n, a in calls)
        return (prefix + "<|python_tag|>" + body) if variant >= 2 else body
    if family == "mistral":
        if variant >= 2:
            return prefix + "".join(f"[TOOL_CALLS]{n}[ARGS]" + json.dumps(a, ensure_ascii=ascii_)
                                    for n, a in calls)
        return prefix + "[TOOL_CALLS]" + json.dumps(
            [{"name": n, "arguments": a} for n, a in calls], ensure_ascii=ascii_)
    if family == "qwen3_coder":
        blocks = []
        for n, a in calls:
            params = "".join(
                f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n"
                for k, v in a.items())
            blocks.append(f"<tool_call>\n<function={n}>\n{params}</function>\n</tool_call>")
        return prefix + "\n".join(blocks)
    if family == "pythonic":
        return " " * variant + "[" + ", ".join(
            f"{n}(" + ", ".join(f"{k}={python_literal(v)}" for k, v in a.items()) + ")"
            for n, a in calls) + "]"
    raise ValueError(family)
