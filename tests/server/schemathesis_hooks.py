"""Schemathesis hooks for tests/server/test_server_schemathesis.py (loaded through
``SCHEMATHESIS_HOOKS``).

One check replaces schemathesis' ``positive_data_acceptance``: a request the schema allows
must not be refused, except for the rules across fields that JSON Schema cannot state and
that the published request schemas describe, each answered with its own code:
``context_length_exceeded`` (the prompt plus ``max_tokens`` must fit the context; every
OpenAI-compatible server refuses it) and ``incompatible_parameters`` (``min_tokens`` above
``max_tokens``, ...). Any other 4xx for schema-valid data fails the run.
"""
from __future__ import annotations

import json
from typing import Any, Optional

import schemathesis

#: refusals that do not mean "your data is wrong" (auth, missing resource, conflict, rate)
NOT_ABOUT_THE_DATA = {401, 403, 404, 409, 429}
#: the codes of the cross-field refusals the request schemas' descriptions announce
CROSS_FIELD_CODES = {"context_length_exceeded", "incompatible_parameters", "unsupported_schema"}


@schemathesis.check
def schema_valid_data_accepted(ctx: Any, response: Any, case: Any) -> Optional[bool]:
    """Schema-valid bodies get 2xx/3xx (or a refusal that is not about the data)."""
    meta = case.meta
    if meta is None or not meta.generation.mode.is_positive:
        return None
    status = response.status_code
    if status < 400 or status >= 500 or status in NOT_ABOUT_THE_DATA:
        return None
    try:
        code = json.loads(response.content)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        code = None
    if status == 400 and code in CROSS_FIELD_CODES:
        return None
    raise AssertionError(f"schema-valid request refused with {status}: "
                         f"{response.content[:400]!r}")
