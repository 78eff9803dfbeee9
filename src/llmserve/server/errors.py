"""Errors in the OpenAI shape: ``{"error": {"message", "type", "param", "code"}}``.

Every error the server returns, whatever raised it (our validation, pydantic,
Starlette's routing, the engine, an unexpected bug), goes through this module so
clients always see the same shape and never a framework's raw dump.
"""
from __future__ import annotations

import logging
from typing import Any, Iterable, Mapping, Optional, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from llmserve.contract.errors import OpenAIError, bad_request
from llmserve.protocol import RequestFailedError

logger = logging.getLogger(__name__)

#: The OpenAI ``type`` string for each status we send.
def error_response(error: OpenAIError) -> JSONResponse:
    """The JSON response that carries ``error`` (status, body and headers)."""
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


_UNION_TAG_CHARS = set("[](),")
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "function-after",
              "function-before", "function-wrap", "literal", "tagged-union"}


def _is_union_tag(part: Any) -> bool:
    return isinstance(part, str) and (
        bool(_UNION_TAG_CHARS & set(part)) or part.lower() in _TYPE_TAGS
        or part.startswith("literal[")
    )


def loc_to_param(loc: Sequence[Any]) -> Optional[str]:
    """Turn a pydantic location like ``("messages", 0, "role")`` into ``messages[0].role``."""
    out = ""
    for part in loc:
        if part in ("body",) and not out:
            continue  # FastAPI prefixes body errors with "body"
        if _is_union_tag(part):
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or None


def validation_error_to_openai(
    errors: Iterable[Mapping[str, Any]], hints: Optional[Mapping[str, str]] = None
) -> OpenAIError:
    """Convert pydantic/FastAPI validation errors into one 400 naming the first bad field.

    ``hints`` maps a top-level field to a description of what it accepts; it is used
    when a union field failed every alternative (pydantic then reports one error per
    alternative, which is noise to a client).
    """
    errors = list(errors)
    if not errors:
        return bad_request("invalid request")
    first = errors[0]
    loc = tuple(first.get("loc", ()))
    kind = first.get("type", "")
    param = loc_to_param(loc)
    if kind == "json_invalid":
        detail = first.get("ctx", {}).get("error") or first.get("msg", "")
        return bad_request(f"The request body is not valid JSON: {detail}", code="invalid_json")
    if kind == "extra_forbidden":
        return bad_request(f"Unrecognized request argument supplied: {param}", param=param,
                           code="unknown_parameter")
    if kind == "model_type" and not param:
        return bad_request("The request body must be a JSON object", code="invalid_json")
    if kind == "missing":
        return bad_request(f"Missing required parameter: '{param}'", param=param,
                           code="missing_required_parameter")
    top = loc[0] if loc and loc[0] != "body" else (loc[1] if len(loc) > 1 else None)
    same_field = [e for e in errors if tuple(e.get("loc", ()))[:1] == loc[:1]]
    if hints and isinstance(top, str) and top in hints and len(same_field) > 1:
        return bad_request(f"Invalid type for '{top}': expected {hints[top]}", param=top,
                           code="invalid_type")
    msg = first.get("msg", "invalid value")
    return bad_request(f"Invalid value for '{param}': {msg}", param=param,
                       code="invalid_type" if kind.endswith("_type") else "invalid_value")


def value_error_to_openai(exc: ValueError) -> OpenAIError:
    """A 400 from a ValueError such as SamplingParams' ("top_p must be in (0, 1], got 2").

    The first word of the message names the field by convention; it becomes ``param``.
    """
    message = str(exc) or "invalid request"
    head = message.split(" ", 1)[0].strip(":,").split("[", 1)[0]
    param = head if head.replace("_", "").isalnum() and head.islower() else None
    return bad_request(message, param=param)


def request_failed_to_openai(exc: RequestFailedError) -> OpenAIError:
    """The error for a request the engine failed alone (the rest of its batch ran on):
    400 when its own input could not be run, else 500; both name the error id that the
    server's log carries with the traceback (also in the ``X-Error-Id`` header)."""
    headers = {"X-Error-Id": exc.error_id}
    if exc.input_error:
        return OpenAIError(400, str(exc), code="invalid_request_input", headers=headers)
    return OpenAIError(500, str(exc), code="engine_error", headers=headers)


# -- FastAPI exception handlers -------------------------------------------------------

_STATUS_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


async def _handle_openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
    return error_response(exc)


async def _handle_request_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
    return error_response(validation_error_to_openai(exc.errors()))


async def _handle_http_exception(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    status = exc.status_code
    detail = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
    if status == 404 and detail == "Not Found":
        detail = f"Unknown endpoint: {request.method} {request.url.path}"
    elif status == 405:
        detail = f"Method {request.method} not allowed on {request.url.path}"
    err = OpenAIError(status, detail, code=_STATUS_CODES.get(status),
                      headers=dict(exc.headers or {}))
    return error_response(err)


def install_error_handlers(app: FastAPI) -> None:
    """Register the handlers that turn every known exception into the OpenAI shape.

    Unexpected exceptions are turned into a 500 by the request middleware
    (``llmserve.server.middleware``), which runs inside Starlette's last-resort
    handler, so it can still add the request id header.
    """
    app.add_exception_handler(OpenAIError, _handle_openai_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _handle_request_validation)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _handle_http_exception)  # type: ignore[arg-type]
