"""Compare grammar engines (llguidance, xgrammar) on one tokenizer: compile and mask times.

``python -m llmserve.bench.grammar_compare [--model PATH] [--repeat N]`` builds each engine's
tokenizer view of the model's vocabulary, then for a fixed set of JSON schemas measures

* compile time: schema -> a matcher ready to produce its first mask (caches disabled, so
  every schema is compiled from scratch), including that first mask;
* mask time per token: walking a valid instance of the schema token by token, the time to
  compute the next-token bitmask at each position (the per-step cost in the sampler) and
  to advance the matcher by the accepted token.

xgrammar is optional (it is not a dependency of llmserve: it imports torch and pulls
triton); an engine that cannot be imported is reported as missing. The figures go in
docs/STRUCTURED_OUTPUTS.md.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any, Callable, Optional

from llmserve.default_model import resolve_model_path
from llmserve.tokenizer.tokenizer import Tokenizer

#: (name, schema, a valid instance) -- the instance is what the mask walk follows.
SCHEMAS: list[tuple[str, dict[str, Any], Any]] = [
    ("flat", {"type": "object", "properties": {"name": {"type": "string"},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False},
     {"name": "Ada Lovelace", "age": 36}),
    ("nested", {"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "id": {"type": "integer", "minimum": 1},
            "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"}},
            "required": ["id", "email"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "score": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["user", "tags", "score"], "additionalProperties": False},
     {"user": {"id": 42, "email": "ada@math.com"}, "tags": ["a", "bb", "ccc"], "score": 0.75}),
    ("enum_array", {"type": "object", "properties": {
        "items": {"type": "array", "items": {"type": "object", "properties": {
            "kind": {"enum": ["apple", "banana", "cherry"]},
            "count": {"type": "integer", "minimum": 0, "maximum": 100}},
            "required": ["kind", "count"], "additionalProperties": False}}},
        "required": ["items"], "additionalProperties": False},
     {"items": [{"kind": "apple", "count": 3}, {"kind": "cherry", "count": 12},
                {"kind": "banana", "count": 7}]}),
    ("optional", {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 40},
        "year": {"type": "integer"}, "subtitle": {"type": "string"},
        "authors": {"type": "array", "items": {"type": "string"}, "minItems": 1}},
        "required": ["title", "authors"], "additionalProperties": False},
     {"title": "On Computable Numbers", "year": 1936, "authors": ["Alan Turing"]}),
    ("any_json", {}, {"free": [{"x": "a value with several words in it"}]}),
]


class _Engine:
    """One grammar engine: ``compile(schema) -> matcher``; ``mask(matcher)``; ``accept``."""

    name = ""
    compile: Callable[[dict], Any]
    mask: Callable[[Any], None]
    accept: Callable[[Any, int], bool]


def _llguidance(tok: Tokenizer, vocab: int, eos: list[int]) -> _Engine:
    import llguidance
    import numpy as np

    t0 = time.perf_counter()
    lltok = llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=vocab, eos_token=eos)
    setup = time.perf_counter() - t0
    buf = np.zeros((vocab + 31) // 32, dtype=np.int32)
    eng = _Engine()
    eng.name, eng.setup_s = "llguidance", setup

    def compile_(schema: dict) -> Any:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), defaults={"whitespace_flexible": False})
        m = llguidance.LLMatcher(lltok, grammar)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    eng.compile = compile_
    eng.mask = lambda m: m.unsafe_compute_mask_ptr(buf.ctypes.data, buf.nbytes)
    eng.accept = lambda m, t: m.consume_token(t)
    return eng


def _xgrammar(tok: Tokenizer, vocab: int, eos: list[int]) -> _Engine:
    import xgrammar

    t0 = time.perf_counter()
    info = xgrammar.TokenizerInfo([tok.token_bytes(i) for i in range(vocab)],
                                  xgrammar.VocabType.RAW, vocab_size=vocab, stop_token_ids=eos)
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    setup = time.perf_counter() - t0
    buf = xgrammar.allocate_token_bitmask(1, vocab)
    eng = _Engine()
    eng.name, eng.setup_s = "xgrammar", setup

    def compile_(schema: dict) -> Any:
        compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                separators=(",", ":"), strict_mode=False)
        return xgrammar.GrammarMatcher(compiled)

    eng.compile = compile_
    eng.mask = lambda m: m.fill_next_token_bitmask(buf)
    eng.accept = lambda m, t: m.accept_token(t)
    return eng


def measure(engine: _Engine, tok: Tokenizer, repeat: int) -> dict[str, Any]:
    """Per schema: median compile-to-first-mask seconds and mean mask seconds per token."""
    rows = {}
    for name, schema, instance in SCHEMAS:
        compile_s = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            m = engine.compile(schema)
            engine.mask(m)
            compile_s.append(time.perf_counter() - t0)
        tokens = tok.encode(json.dumps(instance, separators=(",", ":")), add_special_tokens=False)
        mask_s, accept_s = [], []
        m = engine.compile(schema)
        for t in tokens:
            t0 = time.perf_counter()
            engine.mask(m)
            t1 = time.perf_counter()
            ok = engine.accept(m, t)
            accept_s.append(time.perf_counter() - t1)
            mask_s.append(t1 - t0)
            if not ok:
                raise RuntimeError(f"{engine.name} rejected token {t} of {name}")
        rows[name] = {"compile_ms": statistics.median(compile_s) * 1e3,
                      "mask_us_per_token": statistics.mean(mask_s) * 1e6,
                      "mask_us_p99": sorted(mask_s)[int(0.99 * (len(mask_s) - 1))] * 1e6,
                      "accept_us_per_token": statistics.mean(accept_s) * 1e6,
                      "tokens": len(tokens)}
    return rows


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model path (default: the default model)")
    ap.add_argument("--repeat", type=int, default=3, help="compiles per schema (median)")
    args = ap.parse_args(argv)
    tok = Tokenizer.from_path(resolve_model_path(args.model))
    vocab, eos = tok.vocab_size, sorted(tok.eos_token_ids)
    report: dict[str, Any] = {"vocab_size": vocab}
    for make in (_llguidance, _xgrammar):
        try:
            engine = make(tok, vocab, eos)
        except ImportError as exc:
            report[make.__name__.lstrip("_")] = {"missing": str(exc)}
            continue
        report[engine.name] = {"tokenizer_setup_ms": engine.setup_s * 1e3,
                               "schemas": measure(engine, tok, args.repeat)}
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
