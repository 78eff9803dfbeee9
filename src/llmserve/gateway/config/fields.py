"""Validators for the gateway config file: typed values, strict mappings, TOML.

``_Section`` takes known keys with a type check each and then rejects any unknown key,
so every error names its place (``tenants.acme.keys[0]: ...``). Used by
:mod:`llmserve.gateway.config.gateway_config`.
"""
from __future__ import annotations

import math
import re
from typing import Any, Callable, Mapping

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def parse_toml(text: str) -> Any:
    try:
        import tomllib  # Python 3.11+
    except ModuleNotFoundError:  # pragma: no cover - Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ModuleNotFoundError as e:
            raise ValueError("TOML config files need Python 3.11+ (or the tomli package)") from e
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"not valid TOML: {e}") from e


class Section:
    """One mapping of the config: take known keys with type checks, then reject the rest."""

    def __init__(self, data: Any, path: str) -> None:
        if not isinstance(data, Mapping):
            where = path or "config"
            raise ValueError(f"{where}: expected a mapping, got {kind(data)}")
        self.data = data
        self.path = path
        self.seen: set[str] = set()

    def child(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def take(self, key: str, check: Callable[[Any, str], Any], default: Any) -> Any:
        """The checked value of ``key``; ``default`` when it is absent or null."""
        self.seen.add(key)
        if self.data.get(key) is None:
            return default
        return check(self.data[key], self.child(key))

    def finish(self) -> None:
        for key in self.data:
            if key not in self.seen:
                raise ValueError(f"{self.child(str(key))}: unknown key")


def kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def mapping(value: Any, path: str) -> Mapping:
    if not isinstance(value, Mapping):
        raise ValueError(f"{path}: expected a mapping, got {kind(value)}")
    return value


def string(value: Any, path: str) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{path}: expected a non-empty string, got {kind(value)}")
    return value


def boolean(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{path}: expected true or false, got {kind(value)}")
    return value


def integer(value: Any, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{path}: expected an integer, got {kind(value)}")
    return value


def finite_number(value: Any, path: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{path}: expected a finite number, got {kind(value)}")
    return float(value)


def positive_int(value: Any, path: str) -> int:
    integer(value, path)
    if value < 1:
        raise ValueError(f"{path}: must be at least 1, got {value}")
    return value


def positive_number(value: Any, path: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{path}: expected a number, got {kind(value)}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{path}: must be a finite number > 0, got {value}")
    return float(value)


def string_list(value: Any, path: str) -> list[str]:
    if not isinstance(value, list):
        raise ValueError(f"{path}: expected a list, got {kind(value)}")
    return [string(item, f"{path}[{i}]") for i, item in enumerate(value)]


def identifier(value: Any, path: str) -> str:
    if not isinstance(value, str) or not _NAME_RE.fullmatch(value):   # not match: "$" passes "x\n"
        raise ValueError(f"{path}: names must be 1-64 characters of letters, digits, '_', '.', '-' "
                         f"starting with a letter or digit, got {value!r}")
    return value


def fraction(value: Any, path: str) -> float:
    """A number in [0, 1)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{path}: expected a number, got {kind(value)}")
    if not 0 <= value < 1:
        raise ValueError(f"{path}: must be at least 0 and below 1, got {value}")
    return float(value)
