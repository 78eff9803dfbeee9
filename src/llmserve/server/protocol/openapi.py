"""The JSON Schemas of the generation endpoints, published in ``/openapi.json`` (no torch).

The bodies are parsed by hand (``openai_protocol.parse_request``), so FastAPI cannot
describe them; this module does: request schemas come from the same pydantic models the
parser uses, tightened with what the parser checks beyond types (value ranges of
``SamplingParams``, the app's ``RequestLimits``, the served models' context length and
vocabulary); response schemas from ``api_models``. A body valid under the request schema
can still be refused (400) for cross-field rules: ``min_tokens <= max_tokens``, prompt +
``max_tokens`` within the context, total prompt bytes, ``top_logprobs`` only with
``logprobs``, ``stream_options`` only with ``stream``.

Streams are described as ``text/event-stream`` whose events (``data: <json>``, last
``data: [DONE]``) follow the schema in the media type's ``x-event-schema``: a chunk, or
an error object when the stream fails after it started.
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

_REF = "#/components/schemas/{model}"
#: path -> (request schema, response schema, stream event schema)
ENDPOINTS = {
    "/v1/chat/completions": ("ChatCompletionRequest", "ChatCompletion", "ChatCompletionChunk"),
    "/v1/completions": ("CompletionRequest", "Completion", "CompletionChunk"),
}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": _REF.format(model=name)}


def _tighten(prop: dict[str, Any], **constraints: Any) -> None:
    """Add `constraints` to the non-null alternative(s) of an optional property."""
    branches = [b for b in prop.get("anyOf", [prop]) if b.get("type") != "null"]
    for b in branches:
        b.update(constraints)


def _sampling(props: dict[str, Any], limits: RequestLimits, max_len: int) -> None:
    low_t, high_t = TEMPERATURE_RANGE
    _tighten(props["temperature"], minimum=0, maximum=high_t,
             description=f"0 (greedy) or in [{low_t:g}, {high_t:g}]")
    _tighten(props["top_p"], exclusiveMinimum=0, maximum=1)
    _tighten(props["min_p"], minimum=0, maximum=1)
    _tighten(props["top_k"], minimum=-1, description="-1 (disabled) or at least 1")
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
             description="token id (a string of digits, within the vocabulary) -> bias")
    _tighten(props["structured_outputs"], description=(
        "exactly one of json (a JSON Schema), regex, choice (strings), grammar (Lark or "
        "GBNF) or json_object: true; unsupported schema features are a 400"))
    props["priority"]["anyOf"][0].update(minimum=-PRIORITY_LIMIT, maximum=PRIORITY_LIMIT)
    props["priority"]["anyOf"][1]["enum"] = sorted(PRIORITY_CLASSES)


def request_schemas(limits: RequestLimits, max_model_len: int,
                    vocab_size: Optional[int] = None) -> dict[str, dict[str, Any]]:
    """Component schemas of both request bodies (and the objects they use)."""
    _, top = models_json_schema([(ChatCompletionRequest, "validation"),
                                 (CompletionRequest, "validation")], ref_template=_REF)
    defs: dict[str, dict[str, Any]] = copy.deepcopy(top["$defs"])
    chat, comp = defs["ChatCompletionRequest"]["properties"], defs["CompletionRequest"]["properties"]
    for props in (chat, comp):
        _sampling(props, limits, max_model_len)
    _tighten(chat["max_completion_tokens"], minimum=1, maximum=max_model_len)
    _tighten(chat["top_logprobs"], minimum=0, maximum=20)
    chat["messages"].update(minItems=1, maxItems=limits.max_messages)
    defs["ChatCompletionRequest"]["required"] = ["messages"]
    function = {"type": "object", "additionalProperties": False, "required": ["name"],
                "properties": {"name": {"type": "string", "pattern": "^[A-Za-z0-9_.-]{1,64}$"},
                               "description": {"type": "string"},
                               "parameters": {"type": "object"},
                               "strict": {"type": "boolean"}}}
    _tighten(chat["tools"], items={
        "type": "object", "additionalProperties": False, "required": ["type", "function"],
        "properties": {"type": {"const": "function"}, "function": function}},
        description="function names must be distinct")
    for branch in chat["tool_choice"]["anyOf"]:
        if branch.get("type") == "string":
            branch["enum"] = ["none", "auto", "required"]
        elif branch.get("type") == "object":
            branch.update(description="{'type': 'function', 'function': {'name': ...}}, a "
                                      "function of tools")
    _tighten(chat["response_format"], required=["type"], description=(
        "{'type': 'text'}, {'type': 'json_object'} or {'type': 'json_schema', 'json_schema': "
        "{'name', 'schema', 'strict'?, 'description'?}}"),
        properties={"type": {"enum": ["text", "json_object", "json_schema"]},
                    "json_schema": {"type": "object"}}, additionalProperties=False)
    _tighten(chat["modalities"], items={"const": "text"}, minItems=1, maxItems=1)
    message = defs["ChatMessage"]["properties"]
    message["role"]["enum"] = list(CHAT_ROLES)
    defs["ChatMessage"]["required"] = ["role", "content"]
    message["content"]["anyOf"] = [b for b in message["content"]["anyOf"]
                                   if b.get("type") != "null"]
    message["content"]["anyOf"][1]["maxItems"] = limits.max_content_parts
    _tighten(message["name"], maxLength=limits.max_name_chars)
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
                                         "(<fim_prefix>, <fim_suffix>, <fim_middle>)")
    _tighten(comp["best_of"], minimum=1, maximum=MAX_CHOICES_PER_REQUEST,
             description="at least n; not with stream")
    _tighten(comp["prompt_logprobs"], minimum=0, maximum=20)
    _tighten(comp["max_tokens"], minimum=0, description="0 only with echo (score the prompt)")
    return defs


def response_schemas() -> dict[str, dict[str, Any]]:
    """Component schemas of the response bodies and stream events."""
    _, top = models_json_schema([(m, "validation") for m in RESPONSE_MODELS], ref_template=_REF)
    return copy.deepcopy(top["$defs"])


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
                        "text/event-stream": {
                            "schema": {"type": "string"},
                            "x-event-schema": {"oneOf": [_ref(chunk), _ref("ErrorResponse")]}}}},
            "4XX": {"description": "The request was refused (OpenAI error shape)", **error},
            "5XX": {"description": "Server or engine failure (OpenAI error shape)", **error}},
    }


def install_openapi(app: Any, limits: RequestLimits, max_model_len: int,
                    vocab_size: Optional[int] = None) -> None:
    """Make ``app.openapi()`` describe the generation endpoints' bodies."""
    original: Callable[[], dict[str, Any]] = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = original()
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        components.update(request_schemas(limits, max_model_len, vocab_size))
        components.update(response_schemas())
        for path, names in ENDPOINTS.items():
            op = schema["paths"][path]["post"]
            op.update(_operation(*names))
        app.openapi_schema = schema
        return schema

    app.openapi = openapi
