"""Request fields that constrain the output: ``response_format`` and ``structured_outputs``.

``response_format`` (OpenAI): ``{"type": "text"}`` (no constraint), ``{"type":
"json_object"}`` (any JSON object) or ``{"type": "json_schema", "json_schema": {"name",
"schema", "strict", "description"}}``. ``structured_outputs`` (vLLM's extension, chat and
completions): exactly one of ``json`` (a schema, or a JSON string of one), ``regex``,
``choice`` (list of strings), ``grammar`` (Lark, or llama.cpp GBNF when it has ``::=``),
plus ``json_object: true``. Every constraint is checked here (before admission) so a
feature the grammar engine cannot enforce is a 400 naming it, never an unconstrained
answer. No torch.
"""
from __future__ import annotations

import json
from typing import Any, Optional

from llmserve.contract.errors import INCOMPATIBLE_PARAMETERS, bad_request
from llmserve.structured_output.spec import StructuredOutputSpec, UnsupportedGrammarError, check_spec

_RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
_JSON_SCHEMA_KEYS = {"name", "schema", "strict", "description"}
_STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")
#: structured_outputs keys vLLM also accepts that only tune its own backends: ignored.
IGNORED_STRUCTURED_KEYS = {"disable_fallback", "disable_any_whitespace",
                            "disable_additional_properties", "whitespace_pattern", "backend"}


def _checked(spec: StructuredOutputSpec, param: str) -> StructuredOutputSpec:
    try:
        check_spec(spec)
    except UnsupportedGrammarError as exc:
        raise bad_request(str(exc), param=param, code="unsupported_schema") from None
    return spec


def _make(kind: str, value: Any, param: str) -> StructuredOutputSpec:
    try:
        spec = StructuredOutputSpec(kind, value)
    except ValueError as exc:
        raise bad_request(f"{param}: {exc}", param=param) from None
    return _checked(spec, param)


def from_response_format(fmt: Optional[dict[str, Any]]) -> Optional[StructuredOutputSpec]:
    """The constraint of a ``response_format`` value (None for text or absent)."""
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind not in _RESPONSE_FORMAT_TYPES:
        raise bad_request("response_format.type must be one of "
                          f"{', '.join(_RESPONSE_FORMAT_TYPES)}; got {kind!r}",
                          param="response_format.type")
    extra = set(fmt) - ({"type", "json_schema"} if kind == "json_schema" else {"type"})
    if extra:
        where = f"response_format.{sorted(extra)[0]}"
        raise bad_request(f"Unrecognized request argument supplied: {where}", param=where,
                          code="unknown_parameter")
    if kind == "text":
        return None
    if kind == "json_object":
        return _make("json_object", None, "response_format")
    body = fmt.get("json_schema")
    if not isinstance(body, dict):
        raise bad_request("response_format.json_schema must be an object with 'name' and "
                          "'schema'", param="response_format.json_schema")
    unknown = set(body) - _JSON_SCHEMA_KEYS
    if unknown:
        where = f"response_format.json_schema.{sorted(unknown)[0]}"
        raise bad_request(f"Unrecognized request argument supplied: {where}", param=where,
                          code="unknown_parameter")
    name = body.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request("response_format.json_schema.name must be a non-empty string",
                          param="response_format.json_schema.name")
    if body.get("description") is not None and not isinstance(body["description"], str):
        raise bad_request("response_format.json_schema.description must be a string",
                          param="response_format.json_schema.description")
    if body.get("strict") is not None and not isinstance(body["strict"], bool):
        raise bad_request("response_format.json_schema.strict must be a boolean",
                          param="response_format.json_schema.strict")
    schema = body.get("schema", {})
    if not isinstance(schema, dict):
        raise bad_request("response_format.json_schema.schema must be a JSON Schema object",
                          param="response_format.json_schema.schema")
    return _make("json", schema, "response_format.json_schema.schema")


def from_structured_outputs(value: Optional[dict[str, Any]]) -> Optional[StructuredOutputSpec]:
    """The constraint of a ``structured_outputs`` value (None when absent or empty)."""
    if value is None:
        return None
    unknown = set(value) - set(_STRUCTURED_KEYS) - IGNORED_STRUCTURED_KEYS
    if unknown:
        where = f"structured_outputs.{sorted(unknown)[0]}"
        raise bad_request(f"Unrecognized request argument supplied: {where}", param=where,
                          code="unknown_parameter")
    given = [k for k in _STRUCTURED_KEYS if value.get(k) not in (None, False)]
    if not given:
        return None
    if len(given) > 1:
        raise bad_request(f"structured_outputs takes one constraint, got {', '.join(given)}",
                          param="structured_outputs", code=INCOMPATIBLE_PARAMETERS)
    key = given[0]
    param = f"structured_outputs.{key}"
    raw = value[key]
    if key == "json_object":
        if raw is not True:
            raise bad_request(f"{param} must be true", param=param)
        return _make("json_object", None, param)
    if key == "json":
        if isinstance(raw, str):
            try:
                raw = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise bad_request(f"{param} is not valid JSON: {exc}", param=param,
                                  code="unsupported_schema") from None
        return _make("json", raw, param)
    return _make(key, raw, param)


def request_spec(response_format: Optional[dict[str, Any]],
                 structured_outputs: Optional[dict[str, Any]]) -> Optional[StructuredOutputSpec]:
    """The one constraint of a request; both fields at once is a 400."""
    a = from_response_format(response_format)
    b = from_structured_outputs(structured_outputs)
    if a is not None and b is not None:
        raise bad_request("give either response_format or structured_outputs, not both",
                          param="structured_outputs", code=INCOMPATIBLE_PARAMETERS)
    return a or b
