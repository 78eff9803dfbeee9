"""The JSON Schemas of the generation endpoints, published in ``/openapi.json`` (no torch).

The bodies are parsed by hand (``openai_protocol.parse_request``), so FastAPI cannot
describe them; this module does: request schemas come from the same pydantic models the
parser uses, tightened with what the parser checks beyond types (value ranges of
``SamplingParams``, the app's ``RequestLimits``, the served models' context length and
vocabulary); response schemas from ``api_models``. A body valid under the request schema
can still be refused (400) for rules across fields, which JSON Schema cannot state, and
each such refusal has its own ``code``: ``context_length_exceeded`` (prompt + ``max_tokens``
or ``min_tokens`` beyond the context) and ``incompatible_parameters`` (``min_tokens <=
max_tokens``, ``top_logprobs`` only with ``logprobs``, ``stream_options`` only with
``stream``, ``best_of >= n`` and not streamed, ``max_tokens: 0`` only with ``echo``, a
forced ``tool_choice`` with an output format, prompts x ``n`` at most 128). The request
schemas' descriptions say so; tests/server/test_server_schemathesis.py holds the server to
it.

Streams are described as ``text/event-stream`` whose schema describes each event (the Open
API 3.1 reading): its ``data`` is a chunk or, when the stream fails after it started, an
error object, as JSON (``contentMediaType`` / ``contentSchema``), or the final ``[DONE]``.
"""
from __future__ import annotations

import copy
from typing import Any, Callable, Optional

from pydantic.json_schema import models_json_schema

from llmserve.protocol import PRIORITY_CLASSES, PRIORITY_LIMIT
from llmserve.sampling_params import (
    MAX_TOKEN_ID,
    PENALTY_RANGE,
    REPETITION_PENALTY_RANGE,
    SEED_RANGE,
    TEMPERATURE_RANGE,
)
from llmserve.server.limits import MAX_CHOICES_PER_REQUEST, RequestLimits
from llmserve.server.protocol.api_models import RESPONSE_MODELS
from llmserve.server.protocol.openai import CHAT_ROLES, ChatCompletionRequest, CompletionRequest
from llmserve.server.protocol.structured_request import IGNORED_STRUCTURED_KEYS

_REF = "#/components/schemas/{model}"
#: path -> (request schema, response schema, stream event schema)
ENDPOINTS = {
    "/v1/chat/completions": ("ChatCompletionRequest", "ChatCompletion", "ChatCompletionChunk"),
    "/v1/completions": ("CompletionRequest", "Completion", "CompletionChunk"),
}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": _REF.format(model=name)}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


def _tighten(prop: dict[str, Any], **constraints: Any) -> None:
    """Add `constraints` to the non-null alternative(s) of an optional property."""
    branches = [b for b in prop.get("anyOf", [prop]) if b.get("type") != "null"]
    for b in branches:
        b.update(constraints)


def _sampling(props: dict[str, Any], limits: RequestLimits, max_len: int) -> None:
    low_t, high_t = TEMPERATURE_RANGE
    _tighten(props["temperature"], minimum=0, maximum=high_t,
             description=f"0 (greedy) or in [{low_t:g}, {high_t:g}]",
             **{"not": {"exclusiveMinimum": 0, "exclusiveMaximum": low_t}})
    _tighten(props["top_p"], exclusiveMinimum=0, maximum=1)
    _tighten(props["min_p"], minimum=0, maximum=1)
    _tighten(props["top_k"], minimum=-1, description="-1 or 0 (disabled) or at least 1")
    _tighten(props["n"], minimum=1, maximum=MAX_CHOICES_PER_REQUEST)
    _tighten(props["max_tokens"], minimum=1, maximum=max_len)
    _tighten(props["min_tokens"], minimum=0, maximum=max_len)
    _tighten(props["seed"], minimum=SEED_RANGE[0], maximum=SEED_RANGE[1])
    _tighten(props["repetition_penalty"], minimum=REPETITION_PENALTY_RANGE[0],
             maximum=REPETITION_PENALTY_RANGE[1])
    for name in ("presence_penalty", "frequency_penalty"):
        _tighten(props[name], minimum=PENALTY_RANGE[0], maximum=PENALTY_RANGE[1])
    stop = props["stop"]["anyOf"]
    stop[0].update(minLength=1, maxLength=limits.max_stop_string_chars)
    stop[1].update(maxItems=limits.max_stop_strings,
                   items={"type": "string", "minLength": 1,
                          "maxLength": limits.max_stop_string_chars})
    _tighten(props["stop_token_ids"], maxItems=limits.max_stop_token_ids,
             items={"type": "integer", "minimum": 0, "maximum": MAX_TOKEN_ID})
    _tighten(props["user"], maxLength=limits.max_name_chars)
    _tighten(props["logit_bias"], maxProperties=300, propertyNames={"pattern": "^[0-9]+$"},
             additionalProperties={"type": "number", "minimum": -100, "maximum": 100},
             description="token id (a string of digits) -> bias; ids outside the vocabulary "
                         "are ignored")
    text = {"type": "string", "pattern": r"\S"}
    _tighten(props["structured_outputs"], description=(
        "exactly one of json (a JSON Schema), regex, choice (strings), grammar (Lark or "
        "GBNF) or json_object: true; a constraint that cannot be compiled or matches "
        "nothing is a 400 with code unsupported_schema"), additionalProperties=False,
        properties={
            "json": _nullable({"type": ["object", "string"]}),
            "regex": _nullable(text), "grammar": _nullable(text),
            "choice": _nullable({"type": "array", "minItems": 1, "items": {"type": "string"}}),
            "json_object": _nullable({"type": "boolean"}),
            **{k: {"description": "accepted for vLLM compatibility; ignored"}
               for k in sorted(IGNORED_STRUCTURED_KEYS)}})
    props["priority"]["anyOf"][0].update(minimum=-PRIORITY_LIMIT, maximum=PRIORITY_LIMIT)
    props["priority"]["anyOf"][1]["enum"] = sorted(PRIORITY_CLASSES)


CROSS_FIELD_RULES = (
    "A body this schema accepts may still be refused with 400 for rules across fields: "
    "code `context_length_exceeded` when the prompt plus max_tokens (or min_tokens) does not "
    "fit the model's context; code `incompatible_parameters` when fields valid alone are not "
    "together (min_tokens above max_tokens, top_logprobs without logprobs, stream_options "
    "without stream, best_of below n or streamed, max_tokens 0 without echo, a forced "
    "tool_choice with an output format or naming no tool, a function name given twice, "
    "thinking_budget with a forced tool_choice or an output format, "
    "both response_format and structured_outputs, a suffix with token prompts, more than "
    "128 prompts x n); code `unsupported_schema` when a regex, grammar or JSON Schema "
    "constraint cannot be compiled or matches no string.")


def request_schemas(limits: RequestLimits, max_model_len: int,
                    vocab_size: Optional[int] = None, *, prompt_bundles: bool = True,
                    fill_in_the_middle: bool = True,
                    reasoning: bool = True) -> dict[str, dict[str, Any]]:
    """Component schemas of both request bodies (and the objects they use);
    ``prompt_bundles``: whether a gateway resolves ``prompt_bundle`` (else it is not a
    field: sending it is refused like any unknown field); ``fill_in_the_middle``: whether
    every served tokenizer has FIM tokens (else ``suffix`` can only be empty);
    ``reasoning``: whether every served model has a reasoning parser (else
    ``thinking_budget`` is not a field: a model that does not reason refuses it)."""
    _, top = models_json_schema([(ChatCompletionRequest, "validation"),
                                 (CompletionRequest, "validation")], ref_template=_REF)
    defs: dict[str, dict[str, Any]] = copy.deepcopy(top["$defs"])
    if not prompt_bundles:
        defs["ChatCompletionRequest"]["properties"].pop("prompt_bundle", None)
    if not reasoning:
        defs["ChatCompletionRequest"]["properties"].pop("thinking_budget", None)
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        defs[name]["description"] = CROSS_FIELD_RULES
    chat, comp = defs["ChatCompletionRequest"]["properties"], defs["CompletionRequest"]["properties"]
    for props in (chat, comp):
        _sampling(props, limits, max_model_len)
    _tighten(chat["max_completion_tokens"], minimum=1, maximum=max_model_len)
    _tighten(chat["top_logprobs"], minimum=0, maximum=20)
    if "thinking_budget" in chat:
        _tighten(chat["thinking_budget"], minimum=0, maximum=1_000_000)
    chat["messages"].update(minItems=1, maxItems=limits.max_messages)
    defs["ChatCompletionRequest"]["required"] = ["messages"]
    function = {"type": "object", "additionalProperties": False, "required": ["name"],
                "properties": {"name": {"type": "string", "pattern": "^[A-Za-z0-9_.-]{1,64}$"},
                               "description": {"type": ["string", "null"]},
                               "parameters": {"type": "object"},
                               "strict": {"type": ["boolean", "null"]}}}
    _tighten(chat["tools"], items={
        "type": "object", "additionalProperties": False, "required": ["type", "function"],
        "properties": {"type": {"const": "function"}, "function": function}},
        description="function names must be distinct")
    for branch in chat["tool_choice"]["anyOf"]:
        if branch.get("type") == "string":
            branch["enum"] = ["none", "auto", "required"]
        elif branch.get("type") == "object":
            branch.update(description="{'type': 'function', 'function': {'name': ...}}, a "
                                      "function of tools", required=["type", "function"],
                          additionalProperties=False, properties={
                              "type": {"const": "function"},
                              "function": {"type": "object", "required": ["name"],
                                           "additionalProperties": False,
                                           "properties": {"name": {"type": "string"}}}})
    json_schema = {"type": "object", "required": ["name"], "additionalProperties": False,
                   "properties": {"name": {"type": "string", "minLength": 1},
                                  "schema": {"type": "object"},
                                  "strict": {"type": ["boolean", "null"]},
                                  "description": {"type": ["string", "null"]}}}
    shapes = [{"type": "object", "required": ["type"], "additionalProperties": False,
               "properties": {"type": {"const": kind}}} for kind in ("text", "json_object")]
    shapes.append({"type": "object", "required": ["type", "json_schema"],
                   "additionalProperties": False,
                   "properties": {"type": {"const": "json_schema"}, "json_schema": json_schema}})
    fmt = chat["response_format"]
    fmt["anyOf"] = shapes + [{"type": "null"}]
    fmt["description"] = ("{'type': 'text'}, {'type': 'json_object'} or {'type': "
                          "'json_schema', 'json_schema': {'name', 'schema'?, 'strict'?, "
                          "'description'?}}")
    _tighten(chat["modalities"], items={"const": "text"}, minItems=1, maxItems=1)
    text_part = {"type": "object", "required": ["type", "text"],
                 "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
    _tighten(chat["prediction"], required=["type", "content"], properties={
        "type": {"const": "content"},
        "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": text_part}]}})
    message = defs["ChatMessage"]["properties"]
    message["role"]["enum"] = list(CHAT_ROLES)
    defs["ChatMessage"]["required"] = ["role", "content"]
    message["content"]["anyOf"] = [b for b in message["content"]["anyOf"]
                                   if b.get("type") != "null"]
    message["content"]["anyOf"][1]["maxItems"] = limits.max_content_parts
    _tighten(message["name"], maxLength=limits.max_name_chars)
    _tighten(message["tool_calls"], items={
        "type": "object", "required": ["function"],
        "properties": {"id": {"type": "string"}, "type": {"const": "function"},
                       "function": {"type": "object", "required": ["name"],
                                    "properties": {"name": {"type": "string"},
                                                   "arguments": {"type": "string",
                                                                 "description": "JSON text"}}}}},
        description="an assistant turn's calls, fed back")
    defs["ContentPart"] = {
        "title": "ContentPart", "type": "object", "additionalProperties": False,
        "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
        "required": ["type", "text"], "description": "Only text parts are supported."}
    _tighten(comp["logprobs"], minimum=0, maximum=20)
    token = {"type": "integer", "minimum": 0,
             "maximum": (vocab_size - 1) if vocab_size else MAX_TOKEN_ID}
    comp["prompt"]["anyOf"] = [
        {"type": "string", "minLength": 1, "maxLength": limits.max_prompt_bytes},
        {"type": "array", "minItems": 1, "maxItems": limits.max_prompts,
         "items": {"type": "string", "minLength": 1, "maxLength": limits.max_prompt_bytes}},
        {"type": "array", "minItems": 1, "maxItems": max_model_len, "items": token},
        {"type": "array", "minItems": 1, "maxItems": limits.max_prompts,
         "items": {"type": "array", "minItems": 1, "maxItems": max_model_len, "items": token}}]
    defs["CompletionRequest"]["required"] = ["prompt"]
    _tighten(comp["suffix"], description="only for tokenizers with fill-in-the-middle tokens "
                                         "(<fim_prefix>, <fim_suffix>, <fim_middle>), with a "
                                         "text prompt; \"\" is no suffix")
    if not fill_in_the_middle:   # this server's models have no FIM tokens: only ""
        _tighten(comp["suffix"], maxLength=0)
    _tighten(comp["best_of"], minimum=1, maximum=MAX_CHOICES_PER_REQUEST,
             description="at least n; not with stream")
    _tighten(comp["prompt_logprobs"], minimum=0, maximum=20)
    _tighten(comp["max_tokens"], minimum=0, description="0 only with echo (score the prompt)")
    return defs


def response_schemas() -> dict[str, dict[str, Any]]:
    """Component schemas of the response bodies and stream events."""
    _, top = models_json_schema([(m, "validation") for m in RESPONSE_MODELS], ref_template=_REF)
    return copy.deepcopy(top["$defs"])


def _event(chunk: str) -> dict[str, Any]:
    """One server-sent event of a stream (Open API 3.1: the media type's schema describes
    each event): ``data`` is a chunk or an error object as JSON, or the final ``[DONE]``."""
    payload = {"type": "string", "contentMediaType": "application/json",
               "contentSchema": {"oneOf": [_ref(chunk), _ref("ErrorResponse")]}}
    return {"type": "object", "required": ["data"],
            "properties": {"data": {"anyOf": [{"const": "[DONE]"}, payload]},
                           "event": {"type": "string"}}}


def _operation(request: str, response: str, chunk: str) -> dict[str, Any]:
    error = {"content": {"application/json": {"schema": _ref("ErrorResponse")}}}
    return {
        "requestBody": {"required": True,
                        "content": {"application/json": {"schema": _ref(request)}}},
        "responses": {
            "200": {"description": "The completion: JSON, or server-sent events when "
                                   "`stream` is true",
                    "content": {
                        "application/json": {"schema": _ref(response)},
                        "text/event-stream": {"schema": _event(chunk)}}},
            "4XX": {"description": "The request was refused (OpenAI error shape)", **error},
            "5XX": {"description": "Server or engine failure (OpenAI error shape)", **error}},
    }


def install_openapi(app: Any, limits: RequestLimits, max_model_len: int,
                    vocab_size: Optional[int] = None, *, prompt_bundles: bool = False,
                    fill_in_the_middle: bool = True, reasoning: bool = False) -> None:
    """Make ``app.openapi()`` describe the generation endpoints' bodies (``prompt_bundle``
    only when the gateway resolves bundles)."""
    original: Callable[[], dict[str, Any]] = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = original()
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        components.update(request_schemas(limits, max_model_len, vocab_size,
                                           prompt_bundles=prompt_bundles,
                                           fill_in_the_middle=fill_in_the_middle,
                                           reasoning=reasoning))
        components.update(response_schemas())
        for path, names in ENDPOINTS.items():
            op = schema["paths"][path]["post"]
            op.update(_operation(*names))
        app.openapi_schema = schema
        return schema

    app.openapi = openapi
