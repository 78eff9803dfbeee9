"""Pydantic models of the response bodies, used only to publish their JSON Schema in
``/openapi.json`` (the server builds responses as dicts in responses.py / streaming.py;
tests/server/test_server_fuzz.py checks that what it sends conforms). No torch.
"""
from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

_CLOSED = ConfigDict(extra="forbid")

#: finish_reason as sent: the engine's reasons mapped to OpenAI's (responses.py).
FinishReasonOut = Optional[Literal["stop", "length", "tool_calls"]]
#: the stop string or stop token id that ended a choice (vLLM's extension).
StopReason = Union[str, int, None]


class ErrorDetail(BaseModel):
    model_config = _CLOSED
    message: str
    type: str
    param: Optional[str]
    code: Optional[str]


class ErrorResponse(BaseModel):
    """Every error: ``{"error": {"message", "type", "param", "code"}}``."""

    model_config = _CLOSED
    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    model_config = _CLOSED
    cached_tokens: int = Field(ge=0)


class CompletionTokensDetails(BaseModel):
    """Predicted Outputs: predicted tokens accepted, and the rest of the prediction."""
    model_config = _CLOSED
    accepted_prediction_tokens: int = Field(ge=0)
    rejected_prediction_tokens: int = Field(ge=0)


class Usage(BaseModel):
    model_config = _CLOSED
    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)
    total_tokens: int = Field(ge=0)
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: Optional[CompletionTokensDetails] = None  # with a prediction


class TopLogprob(BaseModel):
    model_config = _CLOSED
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(BaseModel):
    model_config = _CLOSED
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    model_config = _CLOSED
    content: list[TokenLogprob]


class FunctionCall(BaseModel):
    model_config = _CLOSED
    name: str
    arguments: str      # JSON text


class ToolCall(BaseModel):
    model_config = _CLOSED
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(BaseModel):
    """``content`` is null when the message only calls tools; ``refusal`` is always null."""

    model_config = _CLOSED
    role: Literal["assistant"]
    content: Optional[str]
    refusal: None
    tool_calls: Optional[list[ToolCall]] = None


class ChatChoice(BaseModel):
    model_config = _CLOSED
    index: int = Field(ge=0)
    message: AssistantMessage
    logprobs: Optional[ChatLogprobs]
    finish_reason: FinishReasonOut
    stop_reason: StopReason


class _Header(BaseModel):
    model_config = _CLOSED
    id: str
    created: int
    model: str
    system_fingerprint: str


class ChatCompletion(_Header):
    """A non-streamed chat completion."""

    object: Literal["chat.completion"]
    choices: list[ChatChoice]
    usage: Usage


class FunctionCallDelta(BaseModel):
    model_config = _CLOSED
    name: Optional[str] = None
    arguments: str


class ToolCallDelta(BaseModel):
    """A streamed call: first ``index``, ``id``, ``type``, ``function.name`` with empty
    ``arguments``, then ``index`` and the ``arguments`` text."""

    model_config = _CLOSED
    index: int = Field(ge=0)
    id: Optional[str] = None
    type: Optional[Literal["function"]] = None
    function: FunctionCallDelta


class ChatDelta(BaseModel):
    model_config = _CLOSED
    role: Literal["assistant"] = "assistant"
    content: str = ""
    tool_calls: Optional[list[ToolCallDelta]] = None


class ChatChunkChoice(BaseModel):
    model_config = _CLOSED
    index: int = Field(ge=0)
    delta: ChatDelta
    logprobs: Optional[ChatLogprobs]
    finish_reason: FinishReasonOut
    stop_reason: StopReason = None   # only on the chunk that carries finish_reason


class ChatCompletionChunk(_Header):
    """One ``data:`` event of a streamed chat completion (``usage``: only with
    ``stream_options.include_usage``; null on every chunk but the last, which has no
    choices)."""

    object: Literal["chat.completion.chunk"]
    choices: list[ChatChunkChoice]
    usage: Optional[Usage] = None


class CompletionLogprobs(BaseModel):
    model_config = _CLOSED
    tokens: list[str]
    token_logprobs: list[Optional[float]]        # echo: null for the first prompt token
    top_logprobs: list[Optional[dict[str, float]]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    model_config = _CLOSED
    index: int = Field(ge=0)
    text: str
    logprobs: Optional[CompletionLogprobs]
    finish_reason: FinishReasonOut
    stop_reason: StopReason


class Completion(_Header):
    """A non-streamed text completion."""

    object: Literal["text_completion"]
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunk(_Header):
    """One ``data:`` event of a streamed text completion."""

    object: Literal["text_completion"]
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None


RESPONSE_MODELS = (ErrorResponse, ChatCompletion, ChatCompletionChunk, Completion,
                   CompletionChunk)
