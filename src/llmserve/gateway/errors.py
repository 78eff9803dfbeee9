"""Errors the gateway turns into HTTP responses.

Every gateway component raises a :class:`GatewayError` subclass; the HTTP layer catches
the base class and answers with ``err.status``, ``err.headers()`` and the OpenAI-style
body ``err.to_openai_dict()``::

    {"error": {"message": "...", "type": "...", "param": null, "code": "..."}}

No HTTP framework is imported here, so the classes are usable from any server.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Mapping, Optional

if TYPE_CHECKING:
    from llmserve.contract.errors import OpenAIError


def retry_after_seconds(seconds: float) -> int:
    """Whole seconds for a ``Retry-After`` header: rounded up, at least 1."""
    if math.isnan(seconds) or seconds < 1:
        return 1
    if math.isinf(seconds):
        raise ValueError("retry_after must be finite")
    return int(math.ceil(seconds))


class GatewayError(Exception):
    """An error with an HTTP status and an OpenAI-compatible error body.

    Args:
        status: HTTP status code.
        message: human-readable explanation (safe to show to the client).
        type: OpenAI error ``type`` (e.g. ``invalid_request_error``).
        code: machine-readable error code, or None.
        param: the request parameter or header at fault, or None.
        headers: extra response headers (e.g. ``WWW-Authenticate``).
    """

    def __init__(
        self,
        status: int,
        message: str,
        type: str,
        code: Optional[str] = None,
        param: Optional[str] = None,
        headers: Optional[Mapping[str, str]] = None,
    ) -> None:
        super().__init__(message)
        self.status = int(status)
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self._extra_headers = dict(headers or {})

    def to_openai_dict(self) -> dict[str, Any]:
        """The JSON response body, in the shape OpenAI clients parse."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def headers(self) -> dict[str, str]:
        """Response headers for this error (``Retry-After`` where the subclass sets one)."""
        return dict(self._extra_headers)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(status={self.status}, code={self.code!r}, message={self.message!r})"


class _RetryableError(GatewayError):
    """A GatewayError that tells the client when to try again (``Retry-After``)."""

    def __init__(self, status: int, message: str, type: str, code: Optional[str],
                 retry_after: float, param: Optional[str] = None,
                 headers: Optional[Mapping[str, str]] = None) -> None:
        super().__init__(status, message, type, code, param, headers)
        self.retry_after = float(retry_after)

    def headers(self) -> dict[str, str]:
        out = super().headers()
        out["Retry-After"] = str(retry_after_seconds(self.retry_after))
        return out


class AuthenticationError(GatewayError):
    """401: missing, malformed or unknown API key."""

    def __init__(self, message: str = "Invalid API key", code: str = "invalid_api_key") -> None:
        super().__init__(401, message, "authentication_error", code,
                         headers={"WWW-Authenticate": "Bearer"})


class PermissionDeniedError(GatewayError):
    """403: the tenant is authenticated but not allowed to use this model."""

    def __init__(self, message: str, code: str = "model_not_allowed", param: Optional[str] = "model") -> None:
        super().__init__(403, message, "permission_error", code, param)


class InvalidRequest(GatewayError):
    """400: the request can never succeed as sent."""

    def __init__(self, message: str, code: Optional[str] = None, param: Optional[str] = None) -> None:
        super().__init__(400, message, "invalid_request_error", code, param)


class ContextLengthExceeded(InvalidRequest):
    """400: prompt plus max_tokens do not fit the model's context."""

    def __init__(self, message: str, param: Optional[str] = "max_tokens") -> None:
        super().__init__(message, code="context_length_exceeded", param=param)


class RateLimitError(_RetryableError):
    """429: the tenant's request or token rate is exhausted; ``retry_after`` in seconds."""

    def __init__(self, message: str, retry_after: float, code: str = "rate_limit_exceeded") -> None:
        super().__init__(429, message, "rate_limit_error", code, retry_after)


class OverloadedError(_RetryableError):
    """503: the server's queue is full (or the request waited too long in it)."""

    def __init__(self, message: str, retry_after: float, code: str = "server_overloaded") -> None:
        super().__init__(503, message, "overloaded_error", code, retry_after)


class KVCachePressureError(OverloadedError):
    """503: the engine's KV cache is nearly full; retry after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message, retry_after, code="kv_cache_pressure")


class QueueTimeoutError(OverloadedError):
    """503: the request waited in the queue longer than ``queue.timeout_s`` and was removed."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message, retry_after, code="queue_timeout")


class IdempotencyConflict(_RetryableError):
    """409: a request with this Idempotency-Key and the same body is still running;
    ``retry_after`` (seconds) goes out as ``Retry-After``."""

    def __init__(self, message: str = "A request with this Idempotency-Key is still in progress",
                 retry_after: float = 1.0) -> None:
        super().__init__(409, message, "idempotency_error", "idempotency_key_in_use", retry_after,
                         param="Idempotency-Key")


class IdempotencyMismatch(GatewayError):
    """422: this Idempotency-Key was already used with a different request body."""

    def __init__(self, message: str = "This Idempotency-Key was already used with a different request") -> None:
        super().__init__(422, message, "idempotency_error", "idempotency_key_reused", "Idempotency-Key")


def to_openai_error(err: GatewayError) -> "OpenAIError":
    """The server's error for a gateway error: same status, body fields and headers."""
    from llmserve.contract.errors import OpenAIError

    return OpenAIError(err.status, err.message, param=err.param, code=err.code, type=err.type,
                       headers=err.headers())
