"""The per-request summary: one JSON line per finished request, keys in a stable order.

Example line (wrapped here)::

    {"event": "request", "request_id": "req-1", "tenant": "acme", "model": "default",
     "served_model": "default", "fingerprint": "ab12...", "status": 200,
     "finish_reason": "stop", "queue_time_s": 0.002, "ttft_s": 0.041, "duration_s": 0.31,
     "prompt_tokens": 12, "cached_tokens": 0, "completion_tokens": 20}

The known fields come first in ``SUMMARY_FIELDS`` order (those not given are left
out), then any other fields in alphabetical order. Floats are rounded to microseconds
(NaN and infinities become null); other values JSON cannot hold are written with ``str()``.
"""
from __future__ import annotations

import json
import logging
import math
from typing import Any

#: Known fields, in the order they appear in a summary line.
SUMMARY_FIELDS = (
    "request_id", "tenant", "model", "served_model", "fingerprint", "status", "finish_reason",
    "error_code", "queue_time_s", "ttft_s", "duration_s", "prompt_tokens", "cached_tokens",
    "completion_tokens", "idempotency_key", "replayed", "priority", "stream",
)
EVENT = "request"


def format_request_summary(**fields: Any) -> str:
    """The JSON line for one request (see the module docstring for the key order)."""
    if "event" in fields:
        raise ValueError("'event' is reserved in a request summary")
    ordered: dict[str, Any] = {"event": EVENT}
    for name in SUMMARY_FIELDS:
        if name in fields:
            ordered[name] = fields[name]
    for name in sorted(set(fields) - set(SUMMARY_FIELDS)):
        ordered[name] = fields[name]
    for name, value in ordered.items():
        if isinstance(value, float):
            ordered[name] = round(value, 6) if math.isfinite(value) else None
    return json.dumps(ordered, ensure_ascii=False, default=str, allow_nan=False)


def log_request_summary(logger: logging.Logger, level: int = logging.INFO, **fields: Any) -> str:
    """Log one request's summary line on ``logger`` (as the whole message) and return it."""
    line = format_request_summary(**fields)
    logger.log(level, "%s", line)
    return line
