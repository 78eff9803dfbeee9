"""What a request constrains its output to, as plain data, and its grammar (no torch).

A :class:`StructuredOutputSpec` travels inside ``SamplingParams``; the engine compiles it
(``llmserve.structured_output.compiler``) and the runner masks sampling with it. Kinds:

========== ======================================= ===========================================
kind       value                                   from
========== ======================================= ===========================================
json       a JSON Schema (dict)                    ``response_format`` json_schema, ``json``
json_object None (any JSON object)                 ``response_format`` json_object
regex      a regular expression (str)              ``structured_outputs.regex``
choice     a list of strings                       ``structured_outputs.choice``
grammar    a Lark or GBNF grammar (str)            ``structured_outputs.grammar``
lark       a Lark grammar built by llmserve (str)  tool calls (``tool_choice`` required/named)
========== ======================================= ===========================================

Grammars are llguidance's: JSON schemas compile to compact JSON (no free whitespace, so a
model cannot pad the output until it runs out of tokens), properties in schema order.
:func:`check_spec` refuses what the engine cannot enforce with a message that names the
feature, e.g. ``unsupported JSON Schema feature(s): uniqueItems``.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Optional

KINDS = ("json", "json_object", "regex", "choice", "grammar", "lark")
#: JSON compile options: compact separators, no whitespace between tokens (tool calls).
JSON_OPTIONS = {"whitespace_flexible": False}
#: ``--json-whitespace``: what may stand between the tokens of a JSON answer.
JSON_WHITESPACE = ("flexible", "compact")
#: ``flexible``'s whitespace between two JSON tokens: up to 8 spaces or tabs, then at most
#: two line breaks, each followed by up to 32 spaces or tabs of indentation. That takes the
#: whitespace models emit in JSON on their own (a blank line, a space before a line break,
#: pretty-printed indentation), which a one-line-break bound masked in a third of sampled
#: answers, and it is bounded, so that sampling cannot wander into an endless run of blank
#: lines (docs/STRUCTURED_OUTPUTS.md, "Whitespace in JSON answers").
FLEXIBLE_WHITESPACE = r"[\x20\x09]{1,8}|[\x20\x09]{0,8}(\x0D?\x0A[\x20\x09]{0,32}){1,2}"


def json_options(whitespace: str) -> dict[str, Any]:
    """llguidance's JSON options for ``--json-whitespace``: ``flexible`` allows spaces, tabs
    and newlines between JSON tokens (pretty-printed JSON, as vLLM allows by default);
    ``compact`` allows none."""
    if whitespace not in JSON_WHITESPACE:
        raise ValueError(f"json_whitespace must be one of {', '.join(JSON_WHITESPACE)}; "
                         f"got {whitespace!r}")
    if whitespace == "compact":
        return dict(JSON_OPTIONS)
    return {"whitespace_flexible": True, "whitespace_pattern": FLEXIBLE_WHITESPACE}
_UNIMPLEMENTED = re.compile(r"Unimplemented keys: \[(.*?)\]")
#: Largest grammar source accepted (characters of its JSON / text).
MAX_SPEC_CHARS = 256 * 1024


class UnsupportedGrammarError(ValueError):
    """The constraint uses something the grammar engine cannot enforce (a 400)."""


@dataclass(frozen=True)
class StructuredOutputSpec:
    """One output constraint. ``compiled`` is attached by the engine (never by a client)."""

    kind: str
    value: Any = None
    compiled: Any = field(default=None, compare=False, repr=False, hash=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind must be one of {', '.join(KINDS)}, "
                             f"got {self.kind!r}")
        if self.kind == "json" and not isinstance(self.value, dict):
            raise ValueError("a JSON schema must be an object")
        if self.kind in ("regex", "grammar", "lark") and (
                not isinstance(self.value, str) or not self.value.strip()):
            raise ValueError(f"the {self.kind} must be a non-empty string")
        if self.kind == "choice" and (
                not isinstance(self.value, (list, tuple)) or not self.value
                or not all(isinstance(c, str) for c in self.value)):
            raise ValueError("choice must be a non-empty list of strings")

    @cached_property
    def source(self) -> str:
        """The constraint as canonical text (what the cache key hashes)."""
        if self.kind in ("json", "choice"):
            return json.dumps(self.value, sort_keys=True, separators=(",", ":"))
        return "" if self.value is None else str(self.value)

    @cached_property
    def key(self) -> str:
        """sha256 of kind and canonical source: equal constraints share one compiled grammar."""
        return hashlib.sha256(f"{self.kind}\0{self.source}".encode("utf-8")).hexdigest()

    def with_compiled(self, compiled: Any) -> "StructuredOutputSpec":
        spec = StructuredOutputSpec(self.kind, self.value, compiled)
        for computed in ("source", "key"):   # computed once per constraint
            if computed in self.__dict__:
                spec.__dict__[computed] = self.__dict__[computed]
        return spec


def _lark_string(text: str) -> str:
    """A Lark string literal matching exactly ``text``."""
    return json.dumps(text, ensure_ascii=False)


def grammar_text(spec: StructuredOutputSpec,
                 options: Optional[dict[str, Any]] = None) -> str:
    """The llguidance grammar (serialized) that enforces ``spec`` (``options``: the JSON
    compile options of :func:`json_options`, compact by default)."""
    options = JSON_OPTIONS if options is None else options
    from llguidance import LLMatcher

    if len(spec.source) > MAX_SPEC_CHARS:
        raise UnsupportedGrammarError(
            f"the {spec.kind} constraint is too large ({len(spec.source)} characters; "
            f"at most {MAX_SPEC_CHARS})")
    if spec.kind == "json":
        return LLMatcher.grammar_from_json_schema(json.dumps(spec.value), defaults=options)
    if spec.kind == "json_object":
        return LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=options)
    if spec.kind == "regex":
        return LLMatcher.grammar_from_regex(spec.value)
    if spec.kind == "choice":
        alternatives = " | ".join(_lark_string(c) for c in spec.value)
        return LLMatcher.grammar_from_lark(f"start: {alternatives}")
    if spec.kind == "grammar" and "::=" in spec.value:  # GBNF (llama.cpp)
        from llguidance.gbnf_to_lark import gbnf_to_lark

        try:
            return LLMatcher.grammar_from_lark(gbnf_to_lark(spec.value))
        except Exception as exc:  # noqa: BLE001 - the converter raises its own types
            raise UnsupportedGrammarError(f"invalid GBNF grammar: {exc}") from None
    return LLMatcher.grammar_from_lark(spec.value)


def describe_error(spec: StructuredOutputSpec, message: str) -> str:
    """A client-facing message for a grammar the engine refused."""
    found = _UNIMPLEMENTED.search(message)
    if found:
        names = ", ".join(n.strip().strip('"') for n in found.group(1).split(","))
        return f"unsupported JSON Schema feature(s): {names}"
    what = {"json": "JSON schema", "json_object": "JSON object", "regex": "regex",
            "choice": "choice", "grammar": "grammar", "lark": "tool-call grammar"}[spec.kind]
    if "NoExtensionBias" in message:   # llguidance: the language is empty
        return (f"no string matches this {what}: it can never be completed "
                "(e.g. an empty character class, or a rule that only refers to itself)")
    first = message.strip().splitlines()[0] if message.strip() else "invalid"
    detail = " ".join(message.split()) if len(message) < 300 else first
    return f"invalid {what}: {detail}"


def check_spec(spec: StructuredOutputSpec, tokenizer: Optional[Any] = None,
               options: Optional[dict[str, Any]] = None) -> str:
    """Validate ``spec``; return its grammar. Raises UnsupportedGrammarError naming the
    unsupported feature or the error (``tokenizer``: an llguidance LLTokenizer, optional;
    ``options``: JSON compile options, :func:`json_options`)."""
    from llguidance import LLMatcher

    try:
        grammar = grammar_text(spec, options)
    except UnsupportedGrammarError:
        raise
    except ValueError as exc:
        raise UnsupportedGrammarError(describe_error(spec, str(exc))) from None
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    if is_error:
        raise UnsupportedGrammarError(describe_error(spec, messages[0] if messages else ""))
    for m in messages:  # e.g. an ignored keyword: still unenforced, so refuse it
        if _UNIMPLEMENTED.search(m):
            raise UnsupportedGrammarError(describe_error(spec, m))
    return grammar
