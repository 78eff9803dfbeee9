"""Anthropic Messages request bodies, and their translation into a chat completion body.

``/v1/messages`` runs through the same request path as ``/v1/chat/completions`` (gateway
hooks, limits, tokenization, engine, billing): its body is validated here and rewritten as
the chat body that asks for the same thing::

    system (text or text blocks)        -> a leading "system" message
    user text blocks                    -> the user message's text
    user tool_result blocks             -> "tool" messages (before the user's text)
    assistant text / tool_use blocks    -> the assistant message's text / tool_calls
    assistant thinking blocks           -> dropped (templates drop earlier reasoning)
    tools [{name, description, input_schema}] -> function tools
    tool_choice auto / any / tool / none      -> "auto" / "required" / named / "none"
    stop_sequences, max_tokens, temperature, top_p, top_k, metadata.user_id
                                        -> stop, max_tokens, temperature, top_p, top_k, user
    output_config.format (json_schema)  -> response_format json_schema (grammar-enforced)
    thinking enabled (budget_tokens) / disabled -> thinking_budget N / 0, on a model with a
                                           reasoning parser (enabled is a 400 without one)
    cache_control, service_tier, output_config.effort, thinking adaptive / between_tools
                                        -> accepted, no effect (prefixes are cached
                                           automatically)

Anything else (image or document blocks, server tools such as web search, ``thinking``
enabled on a model without a reasoning parser, unknown fields) is a 400
``invalid_request_error``, never ignored. No torch.
"""
from __future__ import annotations

import json
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from llmserve.contract.errors import bad_request
from llmserve.server.errors import validation_error_to_openai

_CLOSED = ConfigDict(extra="forbid")


class TextBlock(BaseModel):
    model_config = ConfigDict(extra="ignore")   # cache_control, citations: accepted, unused
    type: Literal["text"]
    text: str


class ToolUseBlock(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["tool_result"]
    tool_use_id: str
    content: Union[str, list[TextBlock], None] = None
    is_error: bool = False


class ThinkingBlock(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["thinking", "redacted_thinking"]


Block = Union[TextBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock]


class Message(BaseModel):
    model_config = _CLOSED
    role: Literal["user", "assistant"]
    content: Union[str, list[dict[str, Any]]]


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(min_length=1, max_length=128)
    description: Optional[str] = None
    input_schema: dict[str, Any]
    type: Optional[Literal["custom"]] = None


class ToolChoice(BaseModel):
    model_config = _CLOSED
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = None
    disable_parallel_tool_use: Optional[bool] = None


class Thinking(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: Optional[int] = None


class OutputFormat(BaseModel):
    model_config = _CLOSED
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    model_config = _CLOSED
    effort: Optional[Literal["low", "medium", "high", "xhigh", "max"]] = None
    format: Optional[OutputFormat] = None


class Metadata(BaseModel):
    model_config = _CLOSED
    user_id: Optional[str] = None


class MessagesRequest(BaseModel):
    """``POST /v1/messages``."""

    model_config = _CLOSED
    model: str
    messages: list[Message] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: Union[str, list[TextBlock], None] = None
    stop_sequences: Optional[list[str]] = None
    temperature: Optional[float] = Field(default=None, ge=0.0, le=1.0)
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(default=None, ge=1)
    stream: bool = False
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[ToolChoice] = None
    thinking: Optional[Thinking] = None
    metadata: Optional[Metadata] = None
    output_config: Optional[OutputConfig] = None
    cache_control: Optional[dict[str, Any]] = None      # prefixes are cached anyway
    service_tier: Optional[Literal["auto", "standard_only"]] = None


class CountTokensRequest(BaseModel):
    """``POST /v1/messages/count_tokens``: the prompt part of a messages request."""

    model_config = _CLOSED
    model: str
    messages: list[Message] = Field(min_length=1)
    system: Union[str, list[TextBlock], None] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[ToolChoice] = None
    thinking: Optional[Thinking] = None
    output_config: Optional[OutputConfig] = None
    cache_control: Optional[dict[str, Any]] = None


_BLOCKS: dict[str, type[BaseModel]] = {"text": TextBlock, "tool_use": ToolUseBlock,
                                       "tool_result": ToolResultBlock,
                                       "thinking": ThinkingBlock,
                                       "redacted_thinking": ThinkingBlock}


def _blocks(content: Union[str, list[dict[str, Any]]], where: str) -> list[Any]:
    if isinstance(content, str):
        return [TextBlock(type="text", text=content)]
    out = []
    for i, raw in enumerate(content):
        kind = raw.get("type") if isinstance(raw, dict) else None
        cls = _BLOCKS.get(kind) if isinstance(kind, str) else None
        if cls is None:
            raise bad_request(f"{where}.content[{i}]: content blocks of type {kind!r} are not "
                              "supported (text, tool_use, tool_result, thinking)",
                              param=f"{where}.content[{i}].type")
        try:
            out.append(cls.model_validate(raw))
        except ValidationError as exc:
            errors = [dict(e, loc=(*where_loc(where), "content", i, *e["loc"]))
                      for e in exc.errors(include_url=False)]
            raise validation_error_to_openai(errors, {}) from None
    return out


def where_loc(where: str) -> tuple[Any, ...]:
    """``messages[3]`` as a pydantic location, ``("messages", 3)``."""
    name, _, index = where.partition("[")
    return (name, int(index.rstrip("]"))) if index else (name,)


def _text(blocks: Union[str, list[TextBlock], None]) -> str:
    if blocks is None or isinstance(blocks, str):
        return blocks or ""
    return "\n".join(b.text for b in blocks)


def chat_messages(req: Union[MessagesRequest, CountTokensRequest]) -> list[dict[str, Any]]:
    """The chat completion ``messages`` of a messages request (see the module docstring)."""
    out: list[dict[str, Any]] = []
    if _text(req.system):
        out.append({"role": "system", "content": _text(req.system)})
    last = len(req.messages) - 1
    for i, msg in enumerate(req.messages):
        blocks = _blocks(msg.content, f"messages[{i}]")
        text = "\n".join(b.text for b in blocks if isinstance(b, TextBlock))
        if not text and not any(isinstance(b, (ToolUseBlock, ToolResultBlock)) for b in blocks):
            if msg.role == "assistant" and blocks and not any(
                    isinstance(b, TextBlock) for b in blocks):
                continue     # only thinking blocks: nothing this server shows the model
            raise bad_request(f"messages[{i}]: the content must not be empty",
                              param=f"messages[{i}].content")
        if msg.role == "assistant" and i == last:
            raise bad_request("a final assistant message (a prefill for the answer to "
                              "continue) is not supported; end with a user message",
                              param=f"messages[{i}]")
        if msg.role == "assistant":
            if any(isinstance(b, ToolResultBlock) for b in blocks):
                raise bad_request(f"messages[{i}]: tool_result blocks belong in user messages",
                                  param=f"messages[{i}].content")
            calls = [{"id": b.id, "type": "function", "function": {
                "name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}}
                for b in blocks if isinstance(b, ToolUseBlock)]
            entry: dict[str, Any] = {"role": "assistant", "content": text or None}
            if calls:
                entry["tool_calls"] = calls
            elif not text:
                entry["content"] = ""
            out.append(entry)
            continue
        if any(isinstance(b, ToolUseBlock) for b in blocks):
            raise bad_request(f"messages[{i}]: tool_use blocks belong in assistant messages",
                              param=f"messages[{i}].content")
        for b in blocks:
            if isinstance(b, ToolResultBlock):
                result = _text(b.content)
                out.append({"role": "tool", "tool_call_id": b.tool_use_id,
                            "content": f"Error: {result}" if b.is_error else result})
        if text or not any(isinstance(b, ToolResultBlock) for b in blocks):
            out.append({"role": "user", "content": text})
    return out


def chat_tools(req: Union[MessagesRequest, CountTokensRequest]) -> dict[str, Any]:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` of the chat body (or none)."""
    fields: dict[str, Any] = {}
    if req.tools:
        tools = []
        for i, raw in enumerate(req.tools):
            kind = raw.get("type", "custom")
            if kind != "custom":
                raise bad_request(f"tools[{i}]: tools of type {kind!r} are not supported "
                                  "(only client tools with an input_schema)",
                                  param=f"tools[{i}].type")
            try:
                tool = Tool.model_validate(raw)
            except ValueError as exc:
                raise bad_request(f"tools[{i}]: {exc}", param=f"tools[{i}]") from None
            fn: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema}
            if tool.description:
                fn["description"] = tool.description
            tools.append({"type": "function", "function": fn})
        fields["tools"] = tools
    choice = req.tool_choice
    if choice is not None:
        if choice.type == "tool" and not choice.name:
            raise bad_request("tool_choice of type 'tool' needs a name", param="tool_choice.name")
        fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(
            choice.type) or {"type": "function", "function": {"name": choice.name}}
        if choice.disable_parallel_tool_use:
            fields["parallel_tool_calls"] = False
    return fields


def check_thinking(thinking: Optional[Thinking], reasons: bool) -> None:
    """``thinking`` may be disabled or left to the model (``adaptive``, ``between_tools``);
    ``enabled`` asks for thinking blocks, which need a reasoning model (``reasons``: the
    served model has a reasoning parser)."""
    if thinking is not None and thinking.type == "enabled" and not reasons:
        raise bad_request("thinking is not supported by this model (it has no reasoning "
                          "parser); leave it out or set {\"type\": \"disabled\"}",
                          param="thinking.type")


def thinking_budget(thinking: Optional[Thinking], reasons: bool) -> Optional[int]:
    """The chat ``thinking_budget`` of ``thinking`` on a reasoning model: ``enabled`` its
    ``budget_tokens`` (none: unbounded), ``disabled`` 0 (answer at once); None otherwise."""
    if thinking is None or not reasons:
        return None
    if thinking.type == "enabled":
        if thinking.budget_tokens is not None and thinking.budget_tokens < 0:
            raise bad_request("thinking.budget_tokens must be >= 0",
                              param="thinking.budget_tokens")
        return thinking.budget_tokens
    return 0 if thinking.type == "disabled" else None


def chat_body(req: MessagesRequest, reasons: bool = False) -> dict[str, Any]:
    """The ``/v1/chat/completions`` body that asks for what ``req`` asks for (``reasons``:
    the served model has a reasoning parser, so ``thinking`` bounds its think block)."""
    check_thinking(req.thinking, reasons)
    body: dict[str, Any] = {"model": req.model, "messages": chat_messages(req),
                            "max_tokens": req.max_tokens, **chat_tools(req)}
    budget = thinking_budget(req.thinking, reasons)
    if budget is not None:
        body["thinking_budget"] = budget
    if req.stop_sequences:
        body["stop"] = req.stop_sequences
    for name in ("temperature", "top_p", "top_k"):
        value = getattr(req, name)
        if value is not None:
            body[name] = value
    if req.metadata is not None and req.metadata.user_id:
        body["user"] = req.metadata.user_id
    fmt = req.output_config.format if req.output_config is not None else None
    if fmt is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "output", "schema": fmt.schema_, "strict": True}}
    if req.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body
