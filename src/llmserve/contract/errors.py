"""The error every layer raises to answer a client: :class:`OpenAIError`, an HTTP status
with an OpenAI-shaped body ``{"error": {"message", "type", "param", "code"}}``.

The server turns it into the response (:mod:`llmserve.server.errors` installs the
handlers); the gateway raises it from its hooks (401, 403, 429, 503 ...). No HTTP
framework here.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "timeout_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
    504: "timeout_error",
}


def error_type_for(status: int) -> str:
    """The OpenAI error ``type`` that goes with an HTTP status."""
    if status in _TYPE_BY_STATUS:
        return _TYPE_BY_STATUS[status]
    return "server_error" if status >= 500 else "invalid_request_error"


class OpenAIError(Exception):
    """An error to return to the client as an OpenAI-shaped JSON body.

    Args:
        status: HTTP status code.
        message: human-readable explanation.
        param: the request field at fault, if any (e.g. ``"temperature"``).
        code: a machine-readable code (e.g. ``"context_length_exceeded"``).
        type: the OpenAI error type; derived from ``status`` when omitted.
        headers: extra response headers (e.g. ``Retry-After`` on a 429).
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: Optional[str] = None,
        code: Optional[str] = None,
        type: Optional[str] = None,
        headers: Optional[Mapping[str, str]] = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or error_type_for(status)
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        """The JSON body: ``{"error": {...}}``."""
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str, type: str, param: Optional[str] = None, code: Optional[str] = None
) -> dict[str, Any]:
    """Build the OpenAI error object."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


#: ``code`` of a 400 for fields that are each valid but not together (``min_tokens`` above
#: ``max_tokens``, ``stream_options`` without ``stream``, ...): rules a JSON Schema cannot
#: state, so a body /openapi.json accepts may still get it (see server/protocol/openapi.py)
INCOMPATIBLE_PARAMETERS = "incompatible_parameters"


def bad_request(message: str, param: Optional[str] = None, code: Optional[str] = None) -> OpenAIError:
    """A 400 invalid_request_error."""
    return OpenAIError(400, message, param=param, code=code)


# -- pydantic validation errors -> one 400 ---------------------------------------------

#: Pydantic union-member tags that appear in error locations and are not field names.
