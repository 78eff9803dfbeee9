"""Grammar compilation for one tokenizer, cached by constraint hash, off the engine thread.

:class:`GrammarCompiler` owns llguidance's view of the vocabulary (built once per tokenizer) and an
LRU cache ``spec.key -> CompiledGrammar``. ``compile`` is synchronous and thread-safe;
``compile_async`` runs it on the compiler's own worker thread, so the asyncio front
(``AsyncLLM.generate``) compiles a new schema before the request reaches the engine thread:
a schema never stalls the streams already running. The engine thread only copies a
compiled template matcher (``CompiledGrammar.new_matcher``). No torch.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
import threading
import time
from typing import Any, Collection, Optional

from llmserve.structured_output.spec import (
    StructuredOutputSpec,
    UnsupportedGrammarError,
    check_spec,
    describe_error,
    json_options,
)

logger = logging.getLogger(__name__)

#: Compiled grammars kept per tokenizer.
DEFAULT_CACHE_SIZE = 256


class CompiledGrammar:
    """A validated grammar bound to one tokenizer; ``new_matcher`` is a cheap copy."""

    def __init__(self, key: str, grammar: str, template: Any, compile_s: float,
                 eos_token_ids: tuple[int, ...]) -> None:
        self.key = key
        self.grammar = grammar
        self.compile_s = compile_s
        self.eos_token_ids = eos_token_ids
        self._template = template
        self.owner: Any = None    # the GrammarCompiler (tokenizer) it was compiled for

    def new_matcher(self) -> Any:
        """A fresh llguidance ``LLMatcher`` at the start of the grammar."""
        return self._template.deep_copy()


class GrammarCompiler:
    """Compiles StructuredOutputSpecs for one tokenizer (see module docstring)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Collection[int],
                 cache_size: int = DEFAULT_CACHE_SIZE, json_whitespace: str = "flexible") -> None:
        """``json_whitespace``: ``flexible`` or ``compact`` JSON answers (:func:`json_options`)."""
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        self.json_options = json_options(json_whitespace)
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(sorted(int(t) for t in eos_token_ids))
        self.cache_size = cache_size
        self._lltok: Any = None
        self._lock = threading.Lock()
        self._cache: "collections.OrderedDict[str, CompiledGrammar]" = collections.OrderedDict()
        self._pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self.hits = self.misses = 0
        self.compile_seconds_total = 0.0

    def as_engine_stats(self) -> dict[str, float | int]:
        """The EngineStats fields of the compile counters."""
        return {"grammar_compile_seconds_total": self.compile_seconds_total,
                "grammar_cache_hits": self.hits, "grammar_cache_misses": self.misses}

    @property
    def lltokenizer(self) -> Any:
        """llguidance's tokenizer for this vocabulary (built on first use)."""
        with self._lock:
            if self._lltok is None:
                import llguidance

                t0 = time.perf_counter()
                self._lltok = llguidance.LLTokenizer(
                    self._tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                    eos_token=list(self.eos_token_ids) or None)
                logger.info("grammar tokenizer ready in %.2fs", time.perf_counter() - t0)
            return self._lltok

    def cached(self, spec: StructuredOutputSpec) -> Optional[CompiledGrammar]:
        """The compiled grammar of ``spec`` if it is cached (counts a hit)."""
        with self._lock:
            hit = self._cache.get(spec.key)
            if hit is not None:
                self._cache.move_to_end(spec.key)
                self.hits += 1
            return hit

    def compile(self, spec: StructuredOutputSpec) -> CompiledGrammar:
        """Compile (or fetch) ``spec``; raises UnsupportedGrammarError (a ValueError)."""
        hit = self.cached(spec)
        if hit is not None:
            return hit
        import llguidance

        lltok = self.lltokenizer
        t0 = time.perf_counter()
        grammar = check_spec(spec, lltok, self.json_options)
        template = llguidance.LLMatcher(lltok, grammar, log_level=0)
        if template.is_error():
            raise UnsupportedGrammarError(describe_error(spec, template.get_error()))
        template.compute_bitmask()  # builds the lexer now, not on the engine thread
        if template.is_error():
            raise UnsupportedGrammarError(describe_error(spec, template.get_error()))
        elapsed = time.perf_counter() - t0
        compiled = CompiledGrammar(spec.key, grammar, template, elapsed, self.eos_token_ids)
        compiled.owner = self
        with self._lock:
            self.misses += 1
            self.compile_seconds_total += elapsed
            self._cache[spec.key] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        logger.debug("compiled %s grammar %s in %.1f ms", spec.kind, spec.key[:12],
                     elapsed * 1e3)
        return compiled

    async def compile_async(self, spec: StructuredOutputSpec) -> CompiledGrammar:
        """``compile`` on the compiler's worker thread (inline when cached)."""
        hit = self.cached(spec)
        if hit is not None:
            return hit
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix="llmserve-grammar")
            pool = self._pool
        return await asyncio.get_running_loop().run_in_executor(pool, self.compile, spec)

    def bind(self, params: Any, compiled: Optional[CompiledGrammar] = None) -> Any:
        """``params`` (SamplingParams) with its structured-output spec compiled here."""
        spec = getattr(params, "structured_output", None)
        if spec is None:
            return params
        if isinstance(spec.compiled, CompiledGrammar) and spec.compiled.owner is self:
            return params
        compiled = compiled if compiled is not None else self.compile(spec)
        return dataclasses.replace(params, structured_output=spec.with_compiled(compiled))

    def shutdown(self) -> None:
        """Stop the worker thread (if any)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False)
