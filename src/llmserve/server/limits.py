"""Bounds on every variable-size input of a generation request, checked after parsing
and before any tokenization or engine work (no torch).

The request body itself is bounded by ``max_body_bytes`` (413, see serving.py); these
bounds keep a body that fits from costing more than a normal request anyway: many
stop strings, long stop strings (matched on every generated character), huge lists of
stop ids, thousands of messages or content parts, or megabytes of prompt text to
tokenize. Value ranges (temperature, penalties, seed, logprobs ...) are checked by
``SamplingParams``; the context length by the server after tokenizing. Every limit is
documented in docs/GATEWAY.md ("Input limits").
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterator, Sequence, Sized

from llmserve.contract.engine_client import TokenizerLike
from llmserve.contract.errors import OpenAIError, bad_request

#: Most choices (prompts x n) one request may ask for.
MAX_CHOICES_PER_REQUEST = 128


@dataclass(frozen=True)
class RequestLimits:
    """Per-request input bounds (``create_app(input_limits=...)``); each must be >= 1."""

    max_messages: int = 1024             # chat messages per request
    max_content_parts: int = 128         # content parts per message
    max_prompt_bytes: int = 1 << 20      # UTF-8 bytes of all prompt text (1 MiB)
    max_prompts: int = MAX_CHOICES_PER_REQUEST   # prompts in one /v1/completions request
    max_prompt_token_ids: int = 1 << 20  # token ids over all token-id prompts
    max_stop_strings: int = 16           # entries of "stop"
    max_stop_string_chars: int = 1024    # characters of each stop string
    max_stop_token_ids: int = 256        # entries of "stop_token_ids"
    max_name_chars: int = 256            # a message's "name" (and "user")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"RequestLimits.{f.name} must be an integer >= 1, got {value!r}")


DEFAULT_LIMITS = RequestLimits()


def _too_many(param: str, count: int, limit: int, what: str) -> OpenAIError:
    return bad_request(f"{param} has {count} {what}; at most {limit} are allowed",
                       param=param, code="too_many_items")


def _chat_texts(req: Any) -> Iterator[tuple[str, str]]:
    """(param, text) of every user-supplied string a chat prompt is rendered from."""
    for i, m in enumerate(req.messages):
        if isinstance(m.content, str):
            yield f"messages[{i}].content", m.content
        elif m.content is not None:
            for j, part in enumerate(m.content):
                if isinstance(part.text, str):
                    yield f"messages[{i}].content[{j}].text", part.text
        if m.name is not None:
            yield f"messages[{i}].name", m.name


def check_limits(req: Any, limits: RequestLimits, *, chat: bool) -> None:
    """Raise OpenAIError (400) for the first input over its bound.

    ``req`` is a parsed ChatCompletionRequest or CompletionRequest.
    """
    stop = req.stop
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > limits.max_stop_strings:
        raise _too_many("stop", len(stops), limits.max_stop_strings, "strings")
    for i, s in enumerate(stops):
        if len(s) > limits.max_stop_string_chars:
            where = "stop" if isinstance(stop, str) else f"stop[{i}]"
            raise bad_request(f"{where} is {len(s)} characters long; at most "
                              f"{limits.max_stop_string_chars} are allowed",
                              param="stop", code="string_too_long")
    if req.stop_token_ids is not None and len(req.stop_token_ids) > limits.max_stop_token_ids:
        raise _too_many("stop_token_ids", len(req.stop_token_ids), limits.max_stop_token_ids,
                        "ids")
    if req.user is not None and len(req.user) > limits.max_name_chars:
        raise bad_request(f"user must be at most {limits.max_name_chars} characters",
                          param="user", code="string_too_long")
    if chat:
        _check_chat(req, limits)
    else:
        _check_completion(req, limits)


def _check_prompt_bytes(size: int, limits: RequestLimits, param: str) -> None:
    if size > limits.max_prompt_bytes:
        raise bad_request(f"the text of the {param} exceeds {limits.max_prompt_bytes} bytes "
                          f"(UTF-8); shorten it", param=param, code="prompt_too_large")


def _check_chat(req: Any, limits: RequestLimits) -> None:
    if len(req.messages) > limits.max_messages:
        raise _too_many("messages", len(req.messages), limits.max_messages, "messages")
    for i, m in enumerate(req.messages):
        if isinstance(m.content, list) and len(m.content) > limits.max_content_parts:
            raise _too_many(f"messages[{i}].content", len(m.content), limits.max_content_parts,
                            "content parts")
        if m.name is not None and len(m.name) > limits.max_name_chars:
            raise bad_request(f"messages[{i}].name must be at most {limits.max_name_chars} "
                              f"characters", param=f"messages[{i}].name", code="string_too_long")
    size = 0
    for _, text in _chat_texts(req):
        size += len(text.encode("utf-8", "surrogatepass"))
        _check_prompt_bytes(size, limits, "messages")


def _check_completion(req: Any, limits: RequestLimits) -> None:
    p = req.prompt
    if isinstance(p, str) or p is None:
        prompts: list[Any] = [] if p is None else [p]
    elif p and all(isinstance(x, int) for x in p):
        prompts = [p]
    else:
        prompts = list(p)
    if len(prompts) > limits.max_prompts:
        raise _too_many("prompt", len(prompts), limits.max_prompts, "prompts")
    size = ids = 0
    for one in prompts:
        if isinstance(one, str):
            size += len(one.encode("utf-8", "surrogatepass"))
            _check_prompt_bytes(size, limits, "prompt")
        else:
            ids += len(one)
    if ids > limits.max_prompt_token_ids:
        raise bad_request(f"the prompt holds {ids} token ids; at most "
                          f"{limits.max_prompt_token_ids} are allowed", param="prompt",
                          code="prompt_too_large")


def check_token_ids(tokenizer: TokenizerLike, ids: Sequence[int], where: str, param: str) -> None:
    """A 400 naming ``where`` when an id of ``ids`` lies outside ``tokenizer``'s vocabulary
    (``vocab_size``, else its length; only negative ids are refused when it has neither)."""
    vocab = getattr(tokenizer, "vocab_size", None)
    if not isinstance(vocab, int) and isinstance(tokenizer, Sized):
        vocab = len(tokenizer)   # a tokenizer without vocab_size
    for t in ids:
        if t < 0 or (isinstance(vocab, int) and t >= vocab):
            raise bad_request(f"{where} contains token id {t} outside the vocabulary"
                              + (f" [0, {vocab})" if isinstance(vocab, int) else ""),
                              param=param)
