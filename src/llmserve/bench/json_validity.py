"""The ``json-validity`` workload: how often sampled structured outputs are valid.

Every request is a chat request at temperature 1 (the CLI's default for this workload)
with its own ``seed`` and a ``response_format`` of type ``json_schema``; ``--num-prompts``
requests per schema of :data:`VALIDITY_SCHEMAS`, request i of every schema with seed
``--seed + i``, so every server gets the very same requests. The answers end themselves
(no ``ignore_eos``) at ``--output-len`` tokens at most.

Each answer gets one verdict (:func:`score_answer`):

* ``valid``: it parses as JSON (strict: no ``NaN``/``Infinity``) and validates against the
  schema (``jsonschema``), whatever the finish reason;
* ``cut``: not valid and the finish reason is ``length``: cut at ``max_tokens``, the usual
  failure under sampling (a string or a run of whitespace that never closes);
* ``invalid_json`` / ``schema_violation``: not cut, and it does not parse / does not
  validate: the server ended an answer its grammar should not have allowed;
* ``error``: the request failed (an HTTP error such as a 400 for an unsupported
  ``response_format``, a broken stream, a timeout); the error key is counted too.

:func:`validity_summary` counts them per schema and overall (``runs[].metrics.validity``
in results.json, and so in compare.json); :func:`answers` lists every answer.
"""
from __future__ import annotations

import functools
import json
import statistics
from typing import Any, Callable, Optional, Sequence

from llmserve.bench.metrics import RequestRecord
from llmserve.bench.report import fmt, md_table
from llmserve.bench.workloads import RequestSpec, TextTokenizer

#: The verdicts of :func:`score_answer`, in report order.
VERDICTS = ("valid", "invalid_json", "schema_violation", "cut", "error")

def _object(properties: dict[str, Any], required: Sequence[str]) -> dict[str, Any]:
    """A closed JSON-schema object (no properties beyond ``properties``)."""
    return {"type": "object", "properties": properties, "required": list(required),
            "additionalProperties": False}


_STRINGS = {"type": "array", "items": {"type": "string"}, "minItems": 1}
_PERSON = _object({
    "name": {"type": "string"},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"type": "string", "enum": ["engineer", "teacher", "artist", "doctor"]},
    "address": _object({"city": {"type": "string"}, "country": {"type": "string"}},
                       ["city", "country"]),
    "hobbies": {**_STRINGS, "maxItems": 4},
}, ["name", "age", "role", "address", "hobbies"])
_ORDER = _object({
    "customer": {"type": "string"},
    "items": {"type": "array", "minItems": 1, "maxItems": 5, "items": _object({
        "product": {"type": "string"},
        "quantity": {"type": "integer", "minimum": 1, "maximum": 10},
        "price": {"type": "number", "minimum": 0}}, ["product", "quantity", "price"])},
}, ["customer", "items"])
_REVIEW = _object({
    "product": {"type": "string"},
    "rating": {"type": "integer", "minimum": 1, "maximum": 5},
    "sentiment": {"type": "string", "enum": ["positive", "neutral", "negative"]},
    "confidence": {"type": "number", "minimum": 0, "maximum": 1},
    "recommend": {"type": "boolean"},
}, ["product", "rating", "sentiment", "confidence", "recommend"])
_BOOK = _object({
    "title": {"type": "string"},
    "authors": _STRINGS,
    "year": {"type": "integer", "minimum": 1400, "maximum": 2030},
    "subtitle": {"type": "string"},
    "genre": {"type": "string", "enum": ["fiction", "history", "science", "poetry"]},
}, ["title", "authors"])

#: (name, user prompt, schema): a nested object with an enum, a bounded integer and a short
#: list (the person of the earlier scripts/structured_validity.py); a list of objects;
#: enums, bounded numbers and a boolean; optional fields.
VALIDITY_SCHEMAS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("person", "Invent a person and describe them as JSON with their name, age, role, address "
               "(city and country) and a few hobbies.", _PERSON),
    ("order", "Invent a shop order as JSON: the customer's name and a list of items, each with "
              "a product, a quantity and a price.", _ORDER),
    ("review", "Write a short product review as JSON: the product, a rating from 1 to 5, the "
               "sentiment, your confidence between 0 and 1, and whether you recommend it.",
     _REVIEW),
    ("book", "Describe a book as JSON with its title and authors, and its year, subtitle or "
             "genre if you know them.", _BOOK),
)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _validator(schema: dict[str, Any]) -> Callable[[Any], bool]:
    """``is_valid`` of the jsonschema validator the schema asks for (ValueError without it)."""
    return _validator_of(json.dumps(schema, sort_keys=True))


@functools.lru_cache(maxsize=64)
def _validator_of(schema_json: str) -> Callable[[Any], bool]:
    schema = json.loads(schema_json)
    try:
        from jsonschema.validators import validator_for
    except ImportError as exc:
        raise ValueError("the json-validity workload needs the jsonschema package "
                         "(pip install jsonschema)") from exc
    cls = validator_for(schema)
    cls.check_schema(schema)
    return cls(schema).is_valid


def score_answer(text: str, finish_reason: Optional[str], schema: dict[str, Any]) -> str:
    """The verdict (one of :data:`VERDICTS` but ``error``) of one answer to ``schema``."""
    is_valid = _validator(schema)
    try:
        ok = is_valid(json.loads(text, parse_constant=_reject_constant))
        failure = "schema_violation"
    except ValueError:
        ok, failure = False, "invalid_json"
    if ok:
        return "valid"
    return "cut" if finish_reason == "length" else failure


def has_structural_whitespace(text: str) -> bool:
    """Whether ``text`` holds whitespace between JSON tokens (outside strings, not at the ends)."""
    in_string = escaped = False
    for ch in text.strip():
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch.isspace():
            return True
    return False


def json_validity_workload(tokenizer: TextTokenizer, num_per_schema: int, output_len: int,
                           seed: int = 0) -> list[RequestSpec]:
    """``num_per_schema`` requests per schema, request i of each with seed ``seed + i``;
    ordered request-major (every schema's request 0, then request 1, ...)."""
    if num_per_schema < 1 or output_len < 1:
        raise ValueError(f"num_per_schema and output_len must be >= 1, got {num_per_schema}, "
                         f"{output_len}")
    for _, _, schema in VALIDITY_SCHEMAS:
        _validator(schema)          # fails here, before any server starts, without jsonschema
    specs = []
    for i in range(num_per_schema):
        for name, prompt, schema in VALIDITY_SCHEMAS:
            specs.append(RequestSpec(
                f"json-validity-{name}-{i}", prompt, [{"role": "user", "content": prompt}],
                len(tokenizer.encode(prompt, add_special_tokens=False)), output_len,
                extra={"seed": seed + i, "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": name, "schema": schema, "strict": True}}},
                meta={"schema": name, "seed": seed + i}))
    return specs


def _schema_of(spec: RequestSpec) -> dict[str, Any]:
    return spec.extra["response_format"]["json_schema"]["schema"]


def answers(specs: Sequence[RequestSpec], records: Sequence[RequestRecord]) -> list[dict]:
    """Every answer with its schema, seed, verdict, finish reason, tokens and text."""
    out = []
    for spec, rec in zip(specs, records, strict=True):
        text = "".join(rec.reply_text)
        verdict = (score_answer(text, rec.finish_reason, _schema_of(spec)) if rec.success
                   else "error")
        out.append({"id": rec.request_id, "schema": spec.meta["schema"],
                    "seed": spec.meta["seed"], "verdict": verdict,
                    "finish_reason": rec.finish_reason, "error": rec.error,
                    "output_tokens": rec.output_tokens if rec.success else None,
                    "e2e_ms": None if rec.e2e is None else rec.e2e * 1e3,
                    "with_whitespace": rec.success and has_structural_whitespace(text),
                    "text": text})
    return out


def _count(values: Sequence[Optional[str]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        key = v or "none"
        out[key] = out.get(key, 0) + 1
    return out


def _group_summary(group: Sequence[dict]) -> dict:
    ok = [a for a in group if a["verdict"] != "error"]
    verdicts = _count([a["verdict"] for a in group])
    e2e = [a["e2e_ms"] for a in ok if a["e2e_ms"] is not None]
    total, valid = len(group), verdicts.get("valid", 0)
    return {"total": total, "valid": valid, "valid_share": valid / total if total else None,
            "verdicts": {v: verdicts.get(v, 0) for v in VERDICTS},
            "cut_at_max_tokens": sum(a["finish_reason"] == "length" for a in ok),
            "finish_reasons": _count([a["finish_reason"] for a in ok]),
            "errors": _count([a["error"] for a in group if a["verdict"] == "error"]),
            "mean_output_tokens": (statistics.mean(a["output_tokens"] for a in ok)
                                   if ok else None),
            "e2e_ms_mean": statistics.mean(e2e) if e2e else None,
            "e2e_ms_p50": statistics.median(e2e) if e2e else None,
            "with_whitespace": sum(a["with_whitespace"] for a in ok)}


def validity_summary(scored: Sequence[dict]) -> dict:
    """Counts of :func:`answers` per schema (in request order) and overall::

        {"schemas": {"person": {"total", "valid", "valid_share", "verdicts": {...},
                                "cut_at_max_tokens", "finish_reasons": {...}, "errors": {...},
                                "mean_output_tokens", "e2e_ms_mean", "e2e_ms_p50",
                                "with_whitespace"}, ...},
         "overall": {... the same ...}}

    ``cut_at_max_tokens`` counts finish reason ``length`` (a valid answer may be one);
    ``mean_output_tokens`` and latencies are over answered requests.
    """
    names = list(dict.fromkeys(a["schema"] for a in scored))
    return {"schemas": {n: _group_summary([a for a in scored if a["schema"] == n])
                        for n in names},
            "overall": _group_summary(scored)}


def _share(summary: dict) -> str:
    share = summary["valid_share"]
    return f"{summary['valid']}/{summary['total']}" + ("" if share is None else
                                                      f" ({100 * share:.0f}%)")


def validity_markdown(named: Sequence[tuple[str, dict]]) -> str:
    """Markdown of the ``validity`` summaries of one or more servers (``(name, summary)``,
    the first the baseline): valid answers per schema and overall with the ratio of each
    server's valid share to the baseline's, then each server's verdicts and figures."""
    base_name, base = named[0]
    rows_of = list(base["schemas"]) + ["overall"]

    def group(summary: dict, key: str) -> Optional[dict]:
        return summary["overall"] if key == "overall" else summary["schemas"].get(key)

    header = ["Schema"] + [f"{n} valid" for n, _ in named] + [
        f"{n} / {base_name}" for n, _ in named[1:]]
    rows = []
    for key in rows_of:
        cells = [group(s, key) for _, s in named]
        base_share = cells[0]["valid_share"] if cells[0] else None
        rows.append([f"**{key}**" if key == "overall" else key]
                    + ["-" if c is None else _share(c) for c in cells]
                    + ["-" if c is None or not base_share or c["valid_share"] is None
                       else f"{c['valid_share'] / base_share:.2f}x" for c in cells[1:]])
    detail_header = ["Server", "Schema", *VERDICTS, "Cut at max_tokens", "Finish reasons",
                     "Errors", "Mean output tokens", "E2E mean (ms)", "With whitespace"]
    details = []
    for name, summary in named:
        for key in rows_of:
            g = group(summary, key)
            if g is None:
                continue
            details.append([name, key, *(str(g["verdicts"][v]) for v in VERDICTS),
                            str(g["cut_at_max_tokens"]), _pairs(g["finish_reasons"]),
                            _pairs(g["errors"]), fmt(g["mean_output_tokens"], 1),
                            fmt(g["e2e_ms_mean"], 0), str(g["with_whitespace"])])
    return "\n".join([md_table(header, rows), "", md_table(detail_header, details)])


def _pairs(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "-"
