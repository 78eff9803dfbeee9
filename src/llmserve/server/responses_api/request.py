"""OpenAI Responses request bodies, and their translation into a chat completion body.

``POST /v1/responses`` runs through the same request path as ``/v1/chat/completions``
(gateway hooks, limits, idempotency, tokenization, engine, billing): its body is validated
here and rewritten as the chat body that asks for the same thing::

    instructions                         -> a leading "system" message (never carried over
                                            by previous_response_id, as OpenAI does)
    input "text"                         -> one user message
    input message items (user, system, developer, assistant; input_text / output_text parts)
                                         -> chat messages
    function_call items                  -> the assistant message's tool_calls
    function_call_output items           -> "tool" messages
    reasoning items                      -> dropped (this server emits none)
    tools [{type: function, name, parameters, ...}] -> function tools
    tool_choice none / auto / required / {type: function, name} -> the same
    text.format text / json_object / json_schema    -> response_format
    max_output_tokens, temperature, top_p, parallel_tool_calls, user -> the same
    reasoning.effort "none"              -> thinking_budget 0 on a reasoning model (other
                                            efforts: no bound; no effect on other models)

Anything this server cannot do (image, file or audio input; hosted tools such as web or
file search; ``background``; ``truncation: "auto"``; item references; unknown fields) is
a 400 ``invalid_request_error`` naming the field, never ignored. No torch.
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from llmserve.contract.errors import bad_request

_CLOSED = ConfigDict(extra="forbid")

#: ``include`` values accepted: none asks for anything this server would leave out.
ACCEPTED_INCLUDES = frozenset({"reasoning.encrypted_content"})


class TextFormat(BaseModel):
    model_config = _CLOSED
    type: Literal["text", "json_object", "json_schema"]
    name: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    description: Optional[str] = None
    strict: Optional[bool] = None


class TextConfig(BaseModel):
    model_config = _CLOSED
    format: Optional[TextFormat] = None
    verbosity: Optional[Literal["low", "medium", "high"]] = None


class Reasoning(BaseModel):
    model_config = _CLOSED
    effort: Optional[Literal["none", "minimal", "low", "medium", "high", "xhigh"]] = None
    summary: Optional[Literal["auto", "concise", "detailed"]] = None
    generate_summary: Optional[Literal["auto", "concise", "detailed"]] = None


class ResponsesRequest(BaseModel):
    """``POST /v1/responses``."""

    model_config = _CLOSED
    model: Optional[str] = None
    input: Union[str, list[dict[str, Any]]]
    instructions: Optional[str] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: Optional[bool] = None
    text: Optional[TextConfig] = None
    reasoning: Optional[Reasoning] = None
    max_output_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: Optional[float] = Field(default=None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    stream: bool = False
    stream_options: Optional[dict[str, Any]] = None
    store: bool = True
    previous_response_id: Optional[str] = None
    metadata: Optional[dict[str, str]] = None
    user: Optional[str] = None
    safety_identifier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    service_tier: Optional[Literal["auto", "default", "flex", "priority"]] = None
    truncation: Optional[Literal["disabled", "auto"]] = None
    background: Optional[bool] = None
    include: Optional[list[str]] = None

    def check(self) -> None:
        """Refuse what this server does not do (see the module docstring)."""
        if self.background:
            raise bad_request("background responses are not supported; leave out "
                              "'background' and wait for the answer (or stream it)",
                              param="background")
        if self.truncation == "auto":
            raise bad_request("truncation 'auto' is not supported: the input is never "
                              "truncated (a too-long input is a 400)", param="truncation")
        if self.metadata is not None and len(self.metadata) > 16:
            raise bad_request("metadata holds at most 16 pairs", param="metadata")
        for value in self.include or []:
            if value not in ACCEPTED_INCLUDES:
                raise bad_request(f"include {value!r} is not supported", param="include")
        if isinstance(self.input, str) and not self.input:
            raise bad_request("input must not be empty", param="input")
        if isinstance(self.input, list) and not self.input and not self.previous_response_id:
            raise bad_request("input must hold at least one item", param="input")


def _text_of(content: Union[str, list[Any]], where: str, role: str) -> str:
    """The text of a message's content: a string, or input_text / output_text parts."""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text") and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "refusal" and role == "assistant" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        elif kind in ("input_image", "input_file", "input_audio"):
            raise bad_request(f"{where}.content[{j}]: {kind} is not supported (text only)",
                              param=f"{where}.content[{j}].type")
        else:
            raise bad_request(f"{where}.content[{j}] must be an input_text or output_text "
                              "part with a 'text' string", param=f"{where}.content[{j}]")
    return "".join(texts)


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad_request(f"{where}.{key} must be a string", param=f"{where}.{key}")
    return value


def input_messages(items: Union[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The chat messages of a request's ``input`` (see the module docstring)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object", param=where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad_request(f"{where}.role must be user, assistant, system or developer",
                                  param=f"{where}.role")
            content = item.get("content")
            if not isinstance(content, (str, list)):
                raise bad_request(f"{where}.content must be a string or a list of parts",
                                  param=f"{where}.content")
            out.append({"role": "system" if role == "developer" else role,
                        "content": _text_of(content, where, role)})
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", where), "type": "function",
                    "function": {"name": _string(item, "name", where),
                                 "arguments": _string(item, "arguments", where)}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = _text_of(output, where, "tool") if isinstance(output, list) else output
            if not isinstance(text, str):
                raise bad_request(f"{where}.output must be a string", param=f"{where}.output")
            out.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                        "content": text})
        elif kind == "reasoning":
            continue
        else:
            raise bad_request(f"{where}: input items of type {kind!r} are not supported "
                              "(message, function_call, function_call_output, reasoning)",
                              param=f"{where}.type")
    return out


def chat_tools(req: ResponsesRequest) -> dict[str, Any]:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` of the chat body (or none)."""
    fields: dict[str, Any] = {}
    if req.tools:
        tools = []
        for i, tool in enumerate(req.tools):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise bad_request(f"tools[{i}]: tools of type {kind!r} are not supported "
                                  "(only function tools)", param=f"tools[{i}].type")
            unknown = set(tool) - {"type", "name", "description", "parameters", "strict"}
            if unknown:
                raise bad_request(f"tools[{i}].{sorted(unknown)[0]} is not supported",
                                  param=f"tools[{i}].{sorted(unknown)[0]}")
            fn = {k: tool[k] for k in ("name", "description", "parameters", "strict")
                  if tool.get(k) is not None}
            tools.append({"type": "function", "function": fn})
        fields["tools"] = tools
    choice = req.tool_choice
    if isinstance(choice, str):
        fields["tool_choice"] = choice
    elif isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str) \
                or set(choice) - {"type", "name"}:
            raise bad_request("tool_choice must be 'none', 'auto', 'required' or "
                              "{'type': 'function', 'name': ...}", param="tool_choice")
        fields["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    if req.parallel_tool_calls is not None:
        fields["parallel_tool_calls"] = req.parallel_tool_calls
    return fields


def response_format(req: ResponsesRequest) -> Optional[dict[str, Any]]:
    """The chat ``response_format`` of ``text.format`` (None for plain text)."""
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.schema_ is None or not fmt.name:
        raise bad_request("text.format of type json_schema needs a 'name' and a 'schema'",
                          param="text.format")
    spec: dict[str, Any] = {"name": fmt.name, "schema": fmt.schema_}
    if fmt.strict is not None:
        spec["strict"] = fmt.strict
    if fmt.description:
        spec["description"] = fmt.description
    return {"type": "json_schema", "json_schema": spec}


def chat_body(req: ResponsesRequest, history: list[dict[str, Any]],
              new_messages: list[dict[str, Any]], reasons: bool = False) -> dict[str, Any]:
    """The ``/v1/chat/completions`` body that asks for what ``req`` asks for, after the
    chat messages of the conversation it continues (``history``). On a reasoning model
    (``reasons``), ``reasoning.effort`` ``none`` is a thinking budget of 0."""
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else [])
    messages += history + new_messages
    body: dict[str, Any] = {"messages": messages, **chat_tools(req)}
    if req.model:
        body["model"] = req.model
    for name, value in (("max_tokens", req.max_output_tokens), ("temperature", req.temperature),
                        ("top_p", req.top_p), ("user", req.user or req.safety_identifier)):
        if value is not None:
            body[name] = value
    fmt = response_format(req)
    if fmt is not None:
        body["response_format"] = fmt
    if reasons and req.reasoning is not None and req.reasoning.effort == "none":
        body["thinking_budget"] = 0
    if req.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body
