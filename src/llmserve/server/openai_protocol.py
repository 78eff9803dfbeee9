"""Request bodies of the OpenAI-compatible API, and their mapping to SamplingParams.

Validation policy:
  * types are strict: ``"0.5"`` is not a number, ``true`` is not an integer, ``1.0``
    is not an integer; NaN and infinities are rejected;
  * unknown top-level, message-level and content-part fields are rejected with a 400
    that names the field (``code: "unknown_parameter"``) -- silently ignoring a
    misspelled ``max_token`` would return something the caller did not ask for;
  * every variable-size input is bounded (``llmserve.server.limits``);
  * a few OpenAI fields we cannot honour are accepted only with their neutral value
    (``logit_bias: {}``, ``response_format: {"type": "text"}``, ``tools: []``,
    ``tool_choice: "none"``, ``echo: false``, ``best_of`` equal to ``n``, ``suffix: null``);
    any other value is a 400 naming the field.
"""
from __future__ import annotations

from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from llmserve.protocol import priority_value
from llmserve.sampling_params import SamplingParams
from llmserve.server.errors import OpenAIError, bad_request, validation_error_to_openai, \
    value_error_to_openai
from llmserve.server.limits import (DEFAULT_LIMITS, MAX_CHOICES_PER_REQUEST, RequestLimits,
                                    check_limits)

_STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

#: What each union-typed field accepts, for error messages.
FIELD_HINTS = {
    "prompt": "a string, an array of strings, an array of token ids or an array of arrays of token ids",
    "stop": "a string or an array of strings",
    "priority": "an integer or one of 'interactive', 'default', 'batch'",
    "content": "a string or an array of content parts",
    "tool_choice": "'none'",
}


class StreamOptions(BaseModel):
    """``stream_options``: only ``include_usage`` is supported."""

    model_config = _STRICT
    include_usage: Optional[bool] = None


class _SamplingFields(BaseModel):
    """Fields shared by chat and text completions."""

    model_config = _STRICT

    model: Optional[str] = None
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    n: Optional[int] = None
    stop: Union[str, list[str], None] = None
    seed: Optional[int] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    logit_bias: Optional[dict[str, float]] = None
    # Extensions (vLLM-compatible names).
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    priority: Union[int, str, None] = None
    ignore_eos: Optional[bool] = None
    min_tokens: Optional[int] = None
    stop_token_ids: Optional[list[int]] = None
    skip_special_tokens: Optional[bool] = None
    include_stop_str_in_output: Optional[bool] = None
    cache: Optional[bool] = None          # false: never served from / stored in the response cache

    def check_common(self) -> None:
        """Checks that pydantic types cannot express; raises OpenAIError (400)."""
        if self.logit_bias:
            raise bad_request("logit_bias is not supported", param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true",
                              param="stream_options")
        if self.priority is not None:
            try:
                priority_value(self.priority)
            except ValueError as exc:
                raise bad_request(str(exc), param="priority") from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def sampling_kwargs(self) -> dict[str, Any]:
        """SamplingParams keyword args for the fields that were given (others keep defaults)."""
        names = ("temperature", "top_p", "n", "stop", "seed", "presence_penalty",
                 "frequency_penalty", "top_k", "min_p", "repetition_penalty", "ignore_eos",
                 "min_tokens", "stop_token_ids", "skip_special_tokens",
                 "include_stop_str_in_output")
        return {k: getattr(self, k) for k in names if getattr(self, k) is not None}


class ContentPart(BaseModel):
    """One part of a message's content; only ``{"type": "text", "text": ...}`` is supported.

    Other fields are kept by pydantic only so that an image part is reported as an
    unsupported type first; any field besides ``type`` and ``text`` is then a 400.
    """

    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: Optional[str] = None


#: Roles a chat message may have.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


class ChatMessage(BaseModel):
    """One chat message."""

    model_config = _STRICT
    role: str
    content: Union[str, list[ContentPart], None] = None
    name: Optional[str] = None

    def to_template_dict(self, index: int) -> dict[str, Any]:
        """The dict handed to the chat template; content parts are joined with newlines."""
        if self.role not in CHAT_ROLES:
            raise bad_request(f"messages[{index}].role must be one of {', '.join(CHAT_ROLES)};"
                              f" got {self.role!r}", param=f"messages[{index}].role")
        if self.content is None:
            raise bad_request(f"messages[{index}].content is required",
                              param=f"messages[{index}].content")
        if isinstance(self.content, str):
            text = self.content
        else:
            pieces = []
            for j, part in enumerate(self.content):
                if part.type != "text" or part.text is None:
                    raise bad_request(
                        f"only text content parts are supported (got type {part.type!r})",
                        param=f"messages[{index}].content[{j}]")
                if part.model_extra:
                    where = f"messages[{index}].content[{j}].{next(iter(part.model_extra))}"
                    raise bad_request(f"Unrecognized request argument supplied: {where}",
                                      param=where, code="unknown_parameter")
                pieces.append(part.text)
            text = "\n".join(pieces)
        out: dict[str, Any] = {"role": self.role, "content": text}
        if self.name is not None:
            out["name"] = self.name
        return out


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(default_factory=list)
    max_completion_tokens: Optional[int] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = None
    response_format: Optional[dict[str, Any]] = None
    tools: Optional[list[Any]] = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: Optional[bool] = None
    prompt_bundle: Optional[str] = None   # "name@version" or "name": messages put first (gateway)

    def check(self) -> None:
        """Request-level checks beyond types; raises OpenAIError (400)."""
        self.check_common()
        if not self.messages:
            raise bad_request("messages must be a non-empty array", param="messages")
        if self.tools:
            raise bad_request("tools are not supported", param="tools")
        if self.tool_choice not in (None, "none"):
            raise bad_request("tool_choice is not supported", param="tool_choice")
        if self.response_format not in (None, {"type": "text"}):
            raise bad_request("only response_format {'type': 'text'} is supported",
                              param="response_format")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")

    @property
    def requested_max_tokens(self) -> tuple[Optional[int], str]:
        """(value, field name): max_completion_tokens wins over the legacy max_tokens."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    @property
    def num_logprobs(self) -> Optional[int]:
        """SamplingParams.logprobs: None, or how many top alternatives to return."""
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: Union[str, list[str], list[int], list[list[int]], None] = None
    logprobs: Optional[int] = None
    echo: Optional[bool] = None
    best_of: Optional[int] = None
    suffix: Optional[str] = None

    def check(self) -> None:
        """Request-level checks beyond types; raises OpenAIError (400)."""
        self.check_common()
        if self.prompt is None:
            raise bad_request("Missing required parameter: 'prompt'", param="prompt",
                              code="missing_required_parameter")
        if self.echo:
            raise bad_request("echo is not supported", param="echo")
        if self.suffix is not None:
            raise bad_request("suffix is not supported", param="suffix")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise bad_request("best_of different from n is not supported", param="best_of")

    @property
    def requested_max_tokens(self) -> tuple[Optional[int], str]:
        """(value, field name); the legacy completions default is 16 tokens."""
        return (16 if self.max_tokens is None else self.max_tokens), "max_tokens"

    def prompt_list(self) -> list[Union[str, list[int]]]:
        """The prompts as a list of strings / token-id lists; raises OpenAIError if empty."""
        p = self.prompt
        if isinstance(p, str):
            prompts: list[Union[str, list[int]]] = [p]
        elif p and all(isinstance(x, int) for x in p):
            prompts = [list(p)]  # type: ignore[arg-type]
        else:
            prompts = list(p or [])  # type: ignore[arg-type]
        if not prompts:
            raise bad_request("prompt must not be empty", param="prompt")
        for i, one in enumerate(prompts):
            if len(one) == 0:
                where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
                raise bad_request(f"{where} must not be empty", param="prompt")
        return prompts


def parse_request(model_cls: type[BaseModel], body: bytes,
                  limits: RequestLimits = DEFAULT_LIMITS) -> Any:
    """Decode and validate a JSON body into ``model_cls`` and check its sizes against
    ``limits``; raises OpenAIError (400)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(f"The request body is not valid UTF-8 (byte {exc.start})",
                          code="invalid_encoding") from None
    if not text.strip():
        raise bad_request("The request body is empty; expected a JSON object", code="invalid_json")
    try:
        req = model_cls.model_validate_json(text)
    except ValidationError as exc:
        raise validation_error_to_openai(exc.errors(include_url=False), FIELD_HINTS) from None
    req.check()  # type: ignore[attr-defined]
    check_limits(req, limits, chat=model_cls is ChatCompletionRequest)
    return req


#: SamplingParams field -> request field, where the names differ (per endpoint).
_CHAT_PARAM_NAMES = {"logprobs": "top_logprobs"}


def make_sampling_params(
    req: _SamplingFields, max_tokens: Optional[int], max_tokens_field: str,
    logprobs: Optional[int], *, chat: bool,
) -> SamplingParams:
    """Build SamplingParams; an invalid value becomes a 400 naming the request field."""
    kwargs = req.sampling_kwargs()
    kwargs["max_tokens"] = max_tokens
    kwargs["logprobs"] = logprobs
    n = kwargs.get("n", 1)
    if isinstance(n, int) and n > MAX_CHOICES_PER_REQUEST:
        raise bad_request(f"n must be at most {MAX_CHOICES_PER_REQUEST}, got {n}", param="n")
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:
        err = value_error_to_openai(exc)
        raise _rename_param(err, max_tokens_field, chat) from None


def _rename_param(err: OpenAIError, max_tokens_field: str, chat: bool) -> OpenAIError:
    if err.param == "max_tokens":
        err.param = max_tokens_field
        err.message = err.message.replace("max_tokens", max_tokens_field, 1)
    elif chat and err.param in _CHAT_PARAM_NAMES:
        new = _CHAT_PARAM_NAMES[err.param]
        err.message = err.message.replace(err.param, new, 1)
        err.param = new
    return err
