"""The one rule for names an operator or a client chooses that end up in response headers,
logs, metrics labels and URL paths (LoRA adapters, served model names, releases, prompt
bundles, tenants).

A name is 1-128 characters of ASCII letters, digits and ``. _ - : / @ +``, starting with a
letter or a digit: no whitespace, no control character (a newline in a header would break
every response that carries it), nothing a log or a label would need to escape. No torch,
no HTTP framework.
"""
from __future__ import annotations

import re

NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}")
NAME_RULE = ("1-128 characters of ASCII letters, digits and . _ - : / @ +, starting with a "
             "letter or a digit")


def is_valid_name(value: object) -> bool:
    """Whether ``value`` is a string that follows the name rule."""
    return isinstance(value, str) and NAME_PATTERN.fullmatch(value) is not None


def check_name(value: object, what: str) -> str:
    """``value`` when it follows the name rule; ValueError naming ``what`` and the rule."""
    if not is_valid_name(value):
        raise ValueError(f"{what} {value!r} is not a valid name: {NAME_RULE}")
    return str(value)
