"""Tool calling: request validation, the tool-call grammar and the output parsing.

The call format is the model family's (:mod:`llmserve.tool_parsers`, ``--tool-call-parser``,
auto-detected from the chat template; Hermes ``<tool_call>`` blocks by default)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

* ``tool_choice: "none"``: tools stay in the prompt, the output is plain text.
* ``"auto"`` (the default with tools): the output is parsed; calls become ``tool_calls``,
  streamed as they are written (a call's ``arguments`` in pieces as the tokens arrive).
* ``"required"`` / ``{"type": "function", "function": {"name": ...}}``: a grammar forces one
  call (several with ``parallel_tool_calls``, the default) whose arguments follow the
  function's ``parameters`` schema, in the parser's format (Hermes blocks for pythonic and
  qwen3_coder, which read them too).

A chat template that renders ``tools`` itself gets them; for one that does not, the tools
and the format are described in the system message (:func:`llmserve.tokenizer.chat_prompt.prepare_messages`). No torch.
"""
from __future__ import annotations

import re
from typing import Any, Optional, Sequence, Union

from llmserve.contract.errors import INCOMPATIBLE_PARAMETERS, bad_request
from llmserve.structured_output.spec import JSON_OPTIONS, StructuredOutputSpec, UnsupportedGrammarError, check_spec
from llmserve.tool_parsers import PARSERS, ToolCall, ToolCallDeltaStream, ToolParser, new_call_id

__all__ = ["HERMES", "ToolCall", "check_message_tool_calls", "check_tool_choice", "check_tools",
           "new_call_id", "parse_tool_calls", "tool_call_spec", "tool_call_streamer"]

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
#: The default format (and the one of templates without tool support).
HERMES: ToolParser = PARSERS["hermes"]


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


def tool_call_spec(tools: list[dict], choice: Union[str, dict], parallel: bool,
                   parser: ToolParser = HERMES) -> Optional[StructuredOutputSpec]:
    """The grammar that forces tool calls (``required`` or named) in ``parser``'s format,
    else None."""
    if choice in ("none", "auto"):
        return None
    chosen = [t for t in tools if isinstance(choice, str)
              or t["function"]["name"] == choice["name"]]
    # compact JSON, as for response_format
    spec = StructuredOutputSpec("lark", parser.forcing_grammar(chosen, parallel, JSON_OPTIONS))
    try:
        check_spec(spec)
    except UnsupportedGrammarError as exc:
        raise bad_request(f"tools: {exc}", param="tools", code="unsupported_schema") from None
    return spec


def parse_tool_calls(text: str, tools: Sequence[dict], parser: ToolParser = HERMES
                     ) -> tuple[Optional[str], list[ToolCall]]:
    """(content left, calls) from a model output; text that does not parse as a call of a
    known function stays in the content."""
    return parser.parse(text, tools)


def tool_call_streamer(tools: Sequence[dict], parser: ToolParser = HERMES) -> ToolCallDeltaStream:
    """Splits one streamed choice's text into content deltas and tool-call deltas
    (:class:`llmserve.tool_parsers.ToolCallDeltaStream`): text that may still become a
    call is held back; a call is sent as OpenAI streams calls, a delta with its ``index``,
    ``id``, ``type`` and ``function.name`` (empty ``arguments``), then its ``arguments``
    in pieces as they are written."""
    return parser.streamer(tools)
