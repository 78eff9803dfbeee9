"""Tool calling: request validation, the tool-call grammar, the prompt and output parsing.

Format: the Hermes style used by Qwen and by llmserve for templates without tool support
(the default SmolLM2 template)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

several blocks for parallel calls; a JSON array of calls inside one block is read too.

* ``tool_choice: "none"``: tools stay in the prompt, the output is plain text.
* ``"auto"`` (the default with tools): the output is parsed; blocks become ``tool_calls``.
* ``"required"`` / ``{"type": "function", "function": {"name": ...}}``: a grammar forces one
  call (several with ``parallel_tool_calls``, the default) whose arguments follow the
  function's ``parameters`` schema.

A chat template that renders ``tools`` itself gets them; for one that does not, the tools
and the format are described in the system message (:func:`llmserve.tokenizer.chat_prompt.prepare_messages`). No torch.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Optional, Union

from llmserve.contract.errors import INCOMPATIBLE_PARAMETERS, bad_request
from llmserve.structured_output.spec import JSON_OPTIONS, StructuredOutputSpec, UnsupportedGrammarError, check_spec
from llmserve.tokenizer.chat_prompt import CLOSE, OPEN, loads_or_text

_BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.S)
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


@dataclass
class ToolCall:
    """One parsed call: ``arguments`` is the JSON text sent to the client."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def check_tools(tools: Optional[list[Any]]) -> list[dict[str, Any]]:
    """Validated ``tools``: each ``{"type": "function", "function": {name, description?,
    parameters?, strict?}}``; raises OpenAIError (400)."""
    out = []
    names = set()
    for i, tool in enumerate(tools or []):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or \
                not isinstance(tool.get("function"), dict):
            raise bad_request(f"{where} must be {{'type': 'function', 'function': {{...}}}}",
                              param=where)
        unknown = set(tool) - {"type", "function"}
        fn = tool["function"]
        unknown |= {f"function.{k}" for k in set(fn) - {"name", "description", "parameters",
                                                       "strict"}}
        if unknown:
            raise bad_request(f"Unrecognized request argument supplied: {where}."
                              f"{sorted(unknown)[0]}", param=where, code="unknown_parameter")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise bad_request(f"{where}.function.name must be 1-64 letters, digits, '_', '.' "
                              f"or '-'; got {name!r}", param=f"{where}.function.name")
        if name in names:
            raise bad_request(f"{where}: the function name {name!r} is given twice", param=where,
                              code=INCOMPATIBLE_PARAMETERS)
        names.add(name)
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise bad_request(f"{where}.function.parameters must be a JSON Schema object",
                              param=f"{where}.function.parameters")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise bad_request(f"{where}.function.description must be a string",
                              param=f"{where}.function.description")
        if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
            raise bad_request(f"{where}.function.strict must be a boolean",
                              param=f"{where}.function.strict")
        if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
            raise bad_request(f"{where}.function.strict must be a boolean",
                              param=f"{where}.function.strict")
        out.append({"type": "function", "function": {**fn, "parameters": params}})
    return out


def check_message_tool_calls(calls: list[Any], index: int) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` (fed back by the client), validated."""
    out = []
    for j, call in enumerate(calls):
        where = f"messages[{index}].tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(call, dict) or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) \
                or not isinstance(fn.get("arguments", ""), str) \
                or not isinstance(call.get("id", ""), str) \
                or call.get("type", "function") != "function":
            raise bad_request(f"{where} must be {{'id', 'type': 'function', 'function': "
                              "{'name', 'arguments' (a JSON string)}}", param=where)
        out.append({"id": str(call.get("id", "")), "type": "function",
                    "function": {"name": fn["name"], "arguments": fn.get("arguments", "{}")}})
    return out


def check_tool_choice(choice: Union[str, dict, None], tools: list[dict]) -> Union[str, dict]:
    """``none`` / ``auto`` / ``required`` / the named function's name (as a dict)."""
    if choice is None:
        return "auto" if tools else "none"
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise bad_request("tool_choice must be 'none', 'auto', 'required' or "
                              "{'type': 'function', 'function': {'name': ...}}",
                              param="tool_choice")
        if choice != "none" and not tools:
            raise bad_request(f"tool_choice {choice!r} needs tools", param="tool_choice",
                              code=INCOMPATIBLE_PARAMETERS)
        return choice
    fn = choice.get("function") if choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or set(choice) - {"type", "function"} \
            or not isinstance(fn, dict) or set(fn) - {"name"}:
        raise bad_request("a named tool_choice is {'type': 'function', 'function': "
                          "{'name': ...}}", param="tool_choice")
    if name not in {t["function"]["name"] for t in tools}:
        raise bad_request(f"tool_choice names {name!r}, which is not in tools",
                          param="tool_choice", code=INCOMPATIBLE_PARAMETERS)
    return {"name": name}


def _call_schema(tool: dict) -> dict[str, Any]:
    fn = tool["function"]
    return {"type": "object", "properties": {"name": {"const": fn["name"]},
                                             "arguments": fn["parameters"]},
            "required": ["name", "arguments"], "additionalProperties": False}


def tool_call_spec(tools: list[dict], choice: Union[str, dict],
                   parallel: bool) -> Optional[StructuredOutputSpec]:
    """The grammar that forces tool calls (``required`` or named), else None."""
    if choice in ("none", "auto"):
        return None
    chosen = [t for t in tools if isinstance(choice, str)
              or t["function"]["name"] == choice["name"]]
    schema: dict[str, Any] = _call_schema(chosen[0]) if len(chosen) == 1 else {
        "anyOf": [_call_schema(t) for t in chosen]}
    schema["x-guidance"] = dict(JSON_OPTIONS)   # compact JSON, as for response_format
    block = f'"{OPEN}\\n" call "\\n{CLOSE}"'
    more = ' ("\\n" block)*' if parallel else ""
    lark = f"start: block{more}\nblock: {block}\ncall: %json {json.dumps(schema)}"
    spec = StructuredOutputSpec("lark", lark)
    try:
        check_spec(spec)
    except UnsupportedGrammarError as exc:
        raise bad_request(f"tools: {exc}", param="tools", code="unsupported_schema") from None
    return spec


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def parse_tool_calls(text: str, tools: list[dict]) -> tuple[Optional[str], list[ToolCall]]:
    """(content left, calls) from a model output; blocks that do not parse as a call of a
    known function stay in the content."""
    known = {t["function"]["name"] for t in tools}
    calls: list[ToolCall] = []
    kept: list[str] = []
    pos = 0
    for match in _BLOCK.finditer(text):
        parsed = _calls_of(match.group(1), known)
        if parsed is None:
            continue
        kept.append(text[pos:match.start()])
        calls.extend(parsed)
        pos = match.end()
    kept.append(text[pos:])
    content = "".join(kept).strip() if calls else text
    return (content or None) if calls else content, calls


def _calls_of(body: str, known: set[str]) -> Optional[list[ToolCall]]:
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or item.get("name") not in known:
            return None
        args = item.get("arguments", item.get("parameters", {}))
        if isinstance(args, str):
            args = loads_or_text(args)
        calls.append(ToolCall(new_call_id(), item["name"],
                              json.dumps(args, ensure_ascii=False)))
    return calls or None


class ToolCallStreamer:
    """Splits one streamed choice's text into content deltas and tool-call deltas.

    Text that may still become ``<tool_call>`` is held back; a complete block that parses
    as a call is sent as OpenAI streams calls: a delta with the call's ``index``, ``id``,
    ``type`` and ``function.name`` (empty ``arguments``), then one with the ``arguments``
    text. Whitespace between blocks is not sent as content.
    """

    def __init__(self, tools: list[dict]) -> None:
        self.tools = tools
        self.buffer = ""
        self.num_calls = 0

    def _emit_calls(self, block: str) -> Optional[list[dict[str, Any]]]:
        _, calls = parse_tool_calls(block, self.tools)
        if not calls:
            return None
        deltas = []
        for c in calls:
            deltas.append({"index": self.num_calls, "id": c.id, "type": "function",
                           "function": {"name": c.name, "arguments": ""}})
            deltas.append({"index": self.num_calls, "function": {"arguments": c.arguments}})
            self.num_calls += 1
        return deltas

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """(content to send now, tool-call deltas to send now) after ``text``; ``final``
        flushes what was held back."""
        self.buffer += text
        content: list[str] = []
        deltas: list[dict[str, Any]] = []
        while True:
            start = self.buffer.find(OPEN)
            if start < 0:
                keep = 0 if final else _partial_suffix(self.buffer, OPEN)
                content.append(self.buffer[:len(self.buffer) - keep])
                self.buffer = self.buffer[len(self.buffer) - keep:]
                break
            end = self.buffer.find(CLOSE, start)
            if end < 0 and not final:
                content.append(self.buffer[:start])
                self.buffer = self.buffer[start:]
                break
            stop = len(self.buffer) if end < 0 else end + len(CLOSE)
            block = self.buffer[start:stop]
            content.append(self.buffer[:start])
            calls = self._emit_calls(block) if end >= 0 else None
            if calls is None:
                content.append(block)
            else:
                deltas.extend(calls)
            self.buffer = self.buffer[stop:]
        text_out = "".join(content)
        if self.num_calls and not text_out.strip():
            text_out = ""
        return text_out, deltas


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that begins ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0
