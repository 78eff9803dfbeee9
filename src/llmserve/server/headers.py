"""Response headers checked before anything is billed or stored.

A header value with a line break or another control character cannot go on the wire:
the HTTP layer refuses it after the handler returned, the client gets an empty reply, and
a gateway that had already billed the response and stored it for idempotent replay would
serve the broken reply to every retry. So every response header is checked when the
request is admitted, before the engine runs, and a response whose body cannot be encoded
is built before the request is recorded as completed.
"""
from __future__ import annotations

import re
from typing import Mapping, Optional

# RFC 9110 field-name: a token; field-value: visible ASCII/obs-text, spaces and tabs inside
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_VALUE = re.compile(r"[\t\x20-\x7e\x80-\xff]*")


def unsendable_header(headers: Mapping[str, str]) -> Optional[str]:
    """The first header that cannot be sent, described for an error message; None if all
    can (names are tokens; values hold no control character, fit Latin-1 and have no
    leading or trailing white space)."""
    for name, value in headers.items():
        if not isinstance(name, str) or _TOKEN.fullmatch(name) is None:
            return f"name {name!r}"
        if (not isinstance(value, str) or _VALUE.fullmatch(value) is None
                or value != value.strip(" \t")):
            return f"{name}: {value!r}"
    return None
