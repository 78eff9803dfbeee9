"""Request bodies of the OpenAI-compatible API, and their mapping to SamplingParams.

Validation policy:
  * types are strict: ``"0.5"`` is not a number, ``true`` is not an integer; ``1.0`` is
    the integer 1 (JSON Schema's rule, which /openapi.json states) and ``1.5`` is not;
    NaN and infinities are rejected;
  * unknown top-level, message-level and content-part fields are rejected with a 400
    that names the field (``code: "unknown_parameter"``) -- silently ignoring a
    misspelled ``max_token`` would return something the caller did not ask for;
  * every variable-size input is bounded (``llmserve.server.limits``);
  * fields that have no meaning here are accepted and ignored (``store``, ``metadata``,
    ``service_tier``, ``user``, ``modalities: ["text"]``); a field that would change the
    output if honoured and cannot be is a 400 naming it (``modalities`` with audio,
    ``suffix`` without fill-in-the-middle tokens, see docs/STRUCTURED_OUTPUTS.md).
"""
from __future__ import annotations

from typing import Annotated, Any, Optional, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, ValidationError

from llmserve.contract.errors import INCOMPATIBLE_PARAMETERS, OpenAIError, bad_request
from llmserve.protocol import priority_value
from llmserve.sampling_params import MAX_TOKEN_ID, SamplingParams
from llmserve.server.errors import validation_error_to_openai, value_error_to_openai
from llmserve.server.limits import DEFAULT_LIMITS, MAX_CHOICES_PER_REQUEST, RequestLimits, check_limits
from llmserve.server.protocol.structured_request import request_spec
from llmserve.server.protocol.tool_calls import (
    HERMES,
    check_message_tool_calls,
    check_tool_choice,
    check_tools,
    tool_call_spec,
)
from llmserve.server.reasoning.parsers import ReasoningParser
from llmserve.tool_parsers import ToolParser

_STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


def _integral(value: Any) -> Any:
    """A float with no fractional part as the int it equals (JSON Schema counts ``2.0`` as
    an integer); anything else unchanged, for the strict check to judge."""
    if type(value) is float and value.is_integer() and abs(value) < 2.0 ** 63:
        return int(value)
    if type(value) is list and any(type(x) is float for x in value):
        return [_integral(x) for x in value]
    return value


#: an integer field: strict, except that an integral float such as ``5.0`` is the int 5
JsonInt = Annotated[int, BeforeValidator(_integral)]
#: a list of integers (token ids), likewise
JsonInts = Annotated[list[int], BeforeValidator(_integral)]

#: What each union-typed field accepts, for error messages.
FIELD_HINTS = {
    "prompt": "a string, an array of strings, an array of token ids or an array of arrays of token ids",
    "stop": "a string or an array of strings",
    "priority": "an integer or one of 'interactive', 'default', 'batch'",
    "content": "a string or an array of content parts",
    "tool_choice": "'none', 'auto', 'required' or {'type': 'function', 'function': {'name'}}",
}


class StreamOptions(BaseModel):
    """``stream_options``: only ``include_usage`` is supported."""

    model_config = _STRICT
    include_usage: Optional[bool] = None


class _SamplingFields(BaseModel):
    """Fields shared by chat and text completions."""

    model_config = _STRICT

    model: Optional[str] = None
    max_tokens: Optional[JsonInt] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    n: Optional[JsonInt] = None
    stop: Union[str, list[str], None] = None
    seed: Optional[JsonInt] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    logit_bias: Optional[dict[str, float]] = None
    # Accepted and ignored (no meaning for a self-hosted engine; logged at debug level).
    store: Optional[bool] = None
    metadata: Optional[dict[str, str]] = None
    service_tier: Optional[str] = None
    # Extensions (vLLM-compatible names).
    structured_outputs: Optional[dict[str, Any]] = None
    _output_spec: Any = PrivateAttr(default=None)   # set by check(): the output constraint
    top_k: Optional[JsonInt] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    priority: Union[JsonInt, str, None] = None
    ignore_eos: Optional[bool] = None
    min_tokens: Optional[JsonInt] = None
    stop_token_ids: Optional[JsonInts] = None
    skip_special_tokens: Optional[bool] = None
    include_stop_str_in_output: Optional[bool] = None
    cache: Optional[bool] = None          # false: never served from / stored in the response cache

    def check_common(self) -> None:
        """Checks that pydantic types cannot express; raises OpenAIError (400)."""
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true",
                              param="stream_options", code=INCOMPATIBLE_PARAMETERS)
        if self.n is not None and self.n < 1:   # the published schema's minimum
            raise bad_request(f"n must be at least 1, got {self.n}", param="n",
                              code="invalid_value")
        if self.priority is not None:
            try:
                priority_value(self.priority)
            except ValueError as exc:
                raise bad_request(str(exc), param="priority") from None

    @property
    def output_spec(self) -> Any:
        """The StructuredOutputSpec the output must follow (None: unconstrained)."""
        return self._output_spec

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def sampling_kwargs(self) -> dict[str, Any]:
        """SamplingParams keyword args for the fields that were given (others keep defaults)."""
        names = ("temperature", "top_p", "n", "stop", "seed", "presence_penalty",
                 "frequency_penalty", "top_k", "min_p", "repetition_penalty", "ignore_eos",
                 "min_tokens", "stop_token_ids", "skip_special_tokens",
                 "include_stop_str_in_output")
        kwargs = {k: getattr(self, k) for k in names if getattr(self, k) is not None}
        if self.logit_bias:
            kwargs["logit_bias"] = logit_bias_ids(self.logit_bias)
        return kwargs


def logit_bias_ids(bias: dict[str, float]) -> dict[int, float]:
    """OpenAI's ``{"token id as a string": bias}`` as ints; a non-integer key is a 400.
    An id beyond every vocabulary (above ``MAX_TOKEN_ID``) is dropped, as an id beyond this
    model's vocabulary is ignored when the bias is applied."""
    out = {}
    for key, value in bias.items():
        if not key.isascii() or not key.isdigit():
            raise bad_request(f"logit_bias keys must be token ids (strings of digits), got "
                              f"{key!r}", param="logit_bias")
        token = int(key)
        if token <= MAX_TOKEN_ID:
            out[token] = value
    return out


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
    tool_calls: Optional[list[dict[str, Any]]] = None   # assistant turns that called tools
    tool_call_id: Optional[str] = None                  # role "tool": the call answered
    refusal: Optional[str] = None                       # assistant turns fed back: ignored

    def to_template_dict(self, index: int) -> dict[str, Any]:
        """The dict handed to the chat template; content parts are joined with newlines."""
        if self.role not in CHAT_ROLES:
            raise bad_request(f"messages[{index}].role must be one of {', '.join(CHAT_ROLES)};"
                              f" got {self.role!r}", param=f"messages[{index}].role")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise bad_request(f"messages[{index}].content is required",
                              param=f"messages[{index}].content")
        if self.content is None or isinstance(self.content, str):
            text = self.content or ""
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
        if self.tool_calls:
            out["tool_calls"] = check_message_tool_calls(self.tool_calls, index)
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(default_factory=list)
    max_completion_tokens: Optional[JsonInt] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[JsonInt] = None
    response_format: Optional[dict[str, Any]] = None
    tools: Optional[list[Any]] = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: Optional[bool] = None
    prediction: Optional[dict[str, Any]] = None   # Predicted Outputs (docs/SPECULATIVE.md)
    modalities: Optional[list[str]] = None
    thinking_budget: Optional[JsonInt] = None   # a reasoning model thinks at most this many tokens
    include_reasoning: bool = True              # send the reasoning as reasoning_content
    _reasoning: Any = PrivateAttr(default=None)          # the served model's ReasoningParser
    _tools: list = PrivateAttr(default_factory=list)
    _tool_choice: Any = PrivateAttr(default="none")
    _tool_parser: Any = PrivateAttr(default=HERMES)      # the served model's call format
    _request_spec: Any = PrivateAttr(default=None)       # response_format / structured_outputs
    prompt_bundle: Optional[str] = None   # "name@version" or "name": messages put first (gateway)
    _bundle_merged: bool = PrivateAttr(default=False)   # the bundle's tools are in `tools`

    def check(self) -> None:
        """Request-level checks beyond types; raises OpenAIError (400)."""
        self.check_common()
        _ = self.prediction_text   # validates the prediction
        if not self.messages:
            raise bad_request("messages must be a non-empty array", param="messages")
        if self.modalities is not None and self.modalities != ["text"]:
            raise bad_request("only modalities ['text'] is supported", param="modalities")
        if self.thinking_budget is not None and not 0 <= self.thinking_budget <= 1_000_000:
            raise bad_request("thinking_budget must be an integer from 0 to 1000000",
                              param="thinking_budget")
        self._output_spec = self._request_spec = request_spec(self.response_format,
                                                              self.structured_outputs)
        if self.prompt_bundle is None or self._bundle_merged:
            self._check_tools()   # else once the bundle's tools are merged in

    def _check_tools(self) -> None:
        """Tools, tool_choice and the tool-call grammar (on top of the request's own output
        constraint), then top_logprobs; the grammar is in the tool parser's format."""
        spec = self._request_spec
        self._tools = check_tools(self.tools)
        self._tool_choice = check_tool_choice(self.tool_choice, self._tools)
        tool_spec = tool_call_spec(self._tools, self._tool_choice,
                                   self.parallel_tool_calls is not False, self._tool_parser)
        if tool_spec is not None and spec is not None:
            raise bad_request("a required or named tool_choice cannot be combined with "
                              "response_format or structured_outputs", param="tool_choice",
                              code=INCOMPATIBLE_PARAMETERS)
        self._output_spec = tool_spec or spec
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs",
                              code=INCOMPATIBLE_PARAMETERS)

    def merge_bundle_tools(self, tools: Optional[list[dict[str, Any]]]) -> None:
        """Put a prompt bundle's tools before the request's own and run the tool checks
        that :meth:`check` left for now (400 for a name given twice, an unknown choice)."""
        self.tools = list(tools or []) + list(self.tools or [])
        self._bundle_merged = True
        self._check_tools()

    def use_tool_parser(self, parser: ToolParser) -> None:
        """Read and force tool calls in ``parser``'s format (the served model's; checked
        requests start with Hermes): the tool-call grammar is made again for it."""
        if parser is self._tool_parser:
            return
        self._tool_parser = parser
        if self._tools and (self.prompt_bundle is None or self._bundle_merged):
            self._check_tools()

    @property
    def tool_parser(self) -> ToolParser:
        """The tool-call format the output is read (and forced) in."""
        return self._tool_parser

    def use_reasoning_parser(self, parser: Optional[ReasoningParser]) -> None:
        """Split the output's think block with ``parser`` (the served model's; None: the
        model does not reason)."""
        self._reasoning = parser

    @property
    def reasoning_parser(self) -> Optional[ReasoningParser]:
        """The parser that splits this answer's reasoning, or None: no reasoning model, or
        a grammar (response_format, forced tool calls) shapes the output from its first
        token, leaving no room for a think block."""
        return self._reasoning if self._output_spec is None else None

    def sampling_kwargs(self) -> dict[str, Any]:
        """As for every request; a tool parser whose markers are special tokens keeps
        special tokens in the output (unless the request says)."""
        kwargs = super().sampling_kwargs()
        if self.parses_tool_calls and self._tool_parser.keeps_special_tokens:
            kwargs.setdefault("skip_special_tokens", False)
        return kwargs

    @property
    def checked_tools(self) -> list[dict[str, Any]]:
        """The validated tools (empty without tools)."""
        return self._tools

    @property
    def parses_tool_calls(self) -> bool:
        """Whether the output is read for tool calls (tools given, tool_choice not none)."""
        return bool(self._tools) and self._tool_choice != "none"

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

    @property
    def prediction_text(self) -> Optional[str]:
        """``prediction: {"type": "content", "content": str | [{"type": "text", "text"}]}``
        as one string (None without a prediction); raises OpenAIError (400) otherwise."""
        pred = self.prediction
        if pred is None:
            return None
        content = pred.get("content") if isinstance(pred, dict) else None
        if not isinstance(pred, dict) or pred.get("type") != "content" or content is None:
            raise bad_request("prediction must be {'type': 'content', 'content': ...}",
                              param="prediction")
        if isinstance(content, str):
            return content
        if isinstance(content, list) and all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                for p in content):
            return "".join(p["text"] for p in content)
        raise bad_request("prediction.content must be a string or an array of text parts",
                          param="prediction")


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: Union[str, list[str], JsonInts, list[JsonInts], None] = None
    logprobs: Optional[JsonInt] = None
    echo: Optional[bool] = None
    best_of: Optional[JsonInt] = None
    suffix: Optional[str] = None
    prompt_logprobs: Optional[JsonInt] = None   # vLLM's extension: logprobs of the prompt tokens

    def check(self) -> None:
        """Request-level checks beyond types; raises OpenAIError (400)."""
        self.check_common()
        if self.prompt is None:
            raise bad_request("Missing required parameter: 'prompt'", param="prompt",
                              code="missing_required_parameter")
        n = self.n or 1
        if self.best_of is not None:
            if self.best_of < n:
                raise bad_request(f"best_of ({self.best_of}) must be at least n ({n})",
                                  param="best_of", code=INCOMPATIBLE_PARAMETERS)
            if self.best_of > n and self.stream:
                raise bad_request("best_of greater than n cannot be streamed", param="best_of",
                                  code=INCOMPATIBLE_PARAMETERS)
        if self.max_tokens == 0 and not self.echo:
            raise bad_request("max_tokens 0 is only allowed with echo", param="max_tokens",
                              code=INCOMPATIBLE_PARAMETERS)
        self._output_spec = request_spec(None, self.structured_outputs)

    @property
    def num_candidates(self) -> int:
        """Completions generated per prompt: best_of when given, else n."""
        return self.best_of or self.n or 1

    @property
    def wants_prompt_logprobs(self) -> Optional[int]:
        """Top alternatives per prompt token to compute (None: prompt logprobs not needed):
        ``echo`` with ``logprobs``, or the ``prompt_logprobs`` extension."""
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        return self.logprobs if self.echo and self.logprobs is not None else None

    @property
    def requested_max_tokens(self) -> tuple[Optional[int], str]:
        """(value, field name); the legacy completions default is 16 tokens. max_tokens 0
        (echo only: score the prompt) generates one token that is not returned."""
        if self.max_tokens == 0:
            return 1, "max_tokens"
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


def body_text(body: bytes) -> str:
    """A request body as text: a 400 when it is not UTF-8 or holds nothing."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(f"The request body is not valid UTF-8 (byte {exc.start})",
                          code="invalid_encoding") from None
    if not text.strip():
        raise bad_request("The request body is empty; expected a JSON object", code="invalid_json")
    return text


def parse_request(model_cls: type[BaseModel], body: bytes,
                  limits: RequestLimits = DEFAULT_LIMITS) -> Any:
    """Decode and validate a JSON body into ``model_cls`` and check its sizes against
    ``limits``; raises OpenAIError (400)."""
    text = body_text(body)
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
    kwargs["structured_output"] = req.output_spec
    if isinstance(req, CompletionRequest):
        kwargs["n"] = req.num_candidates
        kwargs["prompt_logprobs"] = req.wants_prompt_logprobs
        if req.num_candidates > (req.n or 1) and logprobs is None:
            kwargs["logprobs"] = 0   # best_of ranks candidates by their sampled tokens' logprobs
    min_tokens = kwargs.get("min_tokens")
    if min_tokens is not None and max_tokens is not None and min_tokens > max_tokens:
        raise bad_request(f"min_tokens ({min_tokens}) must not exceed {max_tokens_field} "
                          f"({max_tokens})",
                          param="min_tokens", code=INCOMPATIBLE_PARAMETERS)
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
