"""A deterministic in-process engine for the server tests (implements EngineClient).

FakeTokenizer is byte-level: token id = UTF-8 byte + 3, with three ChatML specials
(0 ``<|endoftext|>``, 1 ``<|im_start|>``, 2 ``<|im_end|>`` = EOS). FakeEngine produces
the bytes of a fixed sentence (which contains a two-byte character, so some
increments carry a token but no text yet), at ``token_delay`` seconds per step,
and keeps honest books: KV blocks per sequence (released on finish or abort),
prompt/generation token counters, a prefix cache keyed by (cache_salt, prompt),
and an aborted-request counter.

Magic words in the prompt drive the failure paths: ``__engine_value_error__``
(ValueError before the first output), ``__engine_crash__`` (RuntimeError before the
first output), ``__crash_midstream__`` (RuntimeError after two steps) and
``__queue_timeout__`` (finishes at once with reason queue_timeout and no tokens).
"""
from __future__ import annotations

import asyncio
import math
import re
import threading
import time
import zlib
from typing import Any, AsyncIterator, Optional, Sequence, Union

from llmserve.protocol import (
    CompletionOutput,
    EngineStats,
    RequestMetrics,
    RequestOutput,
    TokenLogprob,
    TopLogprob,
    priority_value,
)
from llmserve.sampling_params import SamplingParams

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS_ID = 2
_SPECIAL_RE = re.compile("(" + "|".join(re.escape(s) for s in SPECIALS) + ")")
SENTENCE = "Hello from the fake engine, café au lait for everyone. "
CHAT_ROLES = {"system", "developer", "user", "assistant", "tool"}


class FakeTokenizer:
    """Byte-level tokenizer with ChatML specials (see module docstring)."""

    eos_token_ids = [EOS_ID]
    vocab_size = 256 + len(SPECIALS)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids: list[int] = []
        for piece in _SPECIAL_RE.split(text):
            if piece in SPECIALS:
                ids.append(SPECIALS.index(piece))
            elif piece:
                ids.extend(b + len(SPECIALS) for b in piece.encode("utf-8"))
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Bytes back to text; special tokens are kept whatever ``skip_special_tokens``
        says (the fake's callers read them)."""
        out, buf = [], bytearray()
        for i in ids:
            if i < len(SPECIALS):
                out.append(buf.decode("utf-8", errors="replace"))
                buf = bytearray()
                out.append(SPECIALS[i])
            else:
                buf.append(i - len(SPECIALS))
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        parts = []
        for m in messages:
            if m.get("role") not in CHAT_ROLES:
                raise ValueError(f"unknown role {m.get('role')!r}")
            if not isinstance(m.get("content"), str):
                raise ValueError("message content must be a string")
            parts.append(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n")
        if add_generation_prompt:
            parts.append("<|im_start|>assistant\n")
        return "".join(parts)


class _Seq:
    """One choice being generated."""

    def __init__(self, index: int, start: int, natural_len: int) -> None:
        self.index = index
        self.start = start
        self.natural_len = natural_len
        self.ids: list[int] = []
        self.text_len = 0  # characters already emitted
        self.finish: Optional[str] = None


class FakeEngine:
    """Deterministic EngineClient for tests; thread-safe stats."""

    def __init__(self, *, model_name: str = "fake-model", max_model_len: int = 4096,
                 block_size: int = 4, num_blocks: int = 4096, token_delay: float = 0.002,
                 fingerprint: str = "fakefingerprint-0123456789abcdef") -> None:
        self.model_name = model_name
        self.fingerprint = fingerprint
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.token_delay = token_delay
        self.tokenizer = FakeTokenizer()
        self.ready = True
        self.calls: list[dict[str, Any]] = []   # every generate() call, for assertions
        self._lock = threading.Lock()
        self._active: dict[str, int] = {}       # request id -> KV blocks held
        self._abort: set[str] = set()
        self._seen_prompts: set[tuple] = set()
        self._stats = EngineStats(kv_blocks_total=num_blocks)

    # -- EngineClient -------------------------------------------------------------------

    def is_ready(self) -> bool:
        return self.ready

    def get_stats(self) -> EngineStats:
        with self._lock:
            s = self._stats
            return EngineStats(
                num_running=len(self._active), num_waiting=0,
                kv_blocks_used=sum(self._active.values()), kv_blocks_total=self.num_blocks,
                kv_blocks_high_water=s.kv_blocks_high_water, num_preemptions=0,
                num_aborted=s.num_aborted, prefix_query_tokens=s.prefix_query_tokens,
                prefix_hit_tokens=s.prefix_hit_tokens,
                prompt_tokens_total=s.prompt_tokens_total,
                generation_tokens_total=s.generation_tokens_total, num_steps=s.num_steps)

    async def abort(self, request_id: str) -> None:
        with self._lock:
            if request_id in self._active:
                self._abort.add(request_id)

    async def generate(self, prompt: Union[str, list[int]], params: SamplingParams,
                       request_id: str, *, priority: Union[int, str, None] = None,
                       cache_salt: Optional[str] = None,
                       deadline: Optional[float] = None) -> AsyncIterator[RequestOutput]:
        arrival = time.time()
        params.validate()
        priority_value(priority)
        ids = list(prompt) if isinstance(prompt, list) else self.tokenizer.encode(prompt)
        text = self.tokenizer.decode(ids)
        if not ids:
            raise ValueError("prompt is empty")
        if len(ids) + (params.max_tokens or 1) > self.max_model_len:
            raise ValueError(f"prompt ({len(ids)}) + max_tokens exceeds {self.max_model_len}")
        if "__engine_value_error__" in text:
            raise ValueError("the fake engine rejects this prompt")
        if "__engine_crash__" in text:
            raise RuntimeError("the fake engine crashed")
        with self._lock:
            if request_id in self._active:
                raise ValueError(f"request id {request_id!r} is already in flight")
            key = (cache_salt, tuple(ids))
            cached = (len(ids) - 1) // self.block_size * self.block_size if key in self._seen_prompts else 0
            self._seen_prompts.add(key)
            self._stats.prefix_query_tokens += len(ids)
            self._stats.prefix_hit_tokens += cached
            self._stats.prompt_tokens_total += len(ids)
            self._active[request_id] = 0
        self.calls.append({"request_id": request_id, "prompt_ids": ids, "params": params,
                           "priority": priority, "cache_salt": cache_salt, "deadline": deadline})
        metrics = RequestMetrics(arrival_time=arrival)
        h = zlib.crc32(bytes(b % 256 for b in ids))
        # greedy: every choice is the same; sampled: choices differ by index and seed
        salts = [0 if params.is_greedy else 7 * i + 13 * (params.seed or 0) for i in range(params.n)]
        seqs = [_Seq(i, (h + salt) % len(SENTENCE), 8 + (h + salt) % 12)
                for i, salt in enumerate(salts)]
        finished_ok = False
        try:
            self._account(request_id, ids, seqs)
            if "__queue_timeout__" in text:
                await asyncio.sleep(self.token_delay)
                metrics.finished_time = time.time()
                finished_ok = True
                yield RequestOutput(request_id, None, ids, [
                    CompletionOutput(s.index, finish_reason="queue_timeout") for s in seqs],
                    finished=True, metrics=metrics)
                return
            step = 0
            while any(s.finish is None for s in seqs):
                await asyncio.sleep(self.token_delay)
                with self._lock:
                    if request_id in self._abort:
                        return
                if step == 0:
                    metrics.first_scheduled_time = time.time()
                step += 1
                if "__crash_midstream__" in text and step == 3:
                    raise RuntimeError("the fake engine crashed mid-stream")
                outs = [self._step(s, params, deadline) for s in seqs if s.finish is None]
                self._account(request_id, ids, seqs, new_tokens=len(outs))
                now = time.time()
                metrics.first_token_time = metrics.first_token_time or now
                metrics.last_token_time = now
                done = all(s.finish is not None for s in seqs)
                if done:
                    metrics.finished_time = now
                    finished_ok = True
                yield RequestOutput(request_id, None, ids, outs, finished=done,
                                    num_cached_tokens=cached if done else 0,
                                    metrics=metrics if done else None)
        finally:
            with self._lock:
                self._active.pop(request_id, None)
                if request_id in self._abort or not finished_ok:
                    self._stats.num_aborted += 1
                self._abort.discard(request_id)

    # -- internals ---------------------------------------------------------------------

    def _account(self, request_id: str, ids: list[int], seqs: list[_Seq],
                 new_tokens: int = 0) -> None:
        blocks = sum(math.ceil((len(ids) + len(s.ids)) / self.block_size) for s in seqs)
        with self._lock:
            self._active[request_id] = blocks
            st = self._stats
            st.kv_blocks_high_water = max(st.kv_blocks_high_water, sum(self._active.values()))
            st.generation_tokens_total += new_tokens
            st.num_steps += 1 if new_tokens else 0

    def _step(self, s: _Seq, params: SamplingParams, deadline: Optional[float]) -> CompletionOutput:
        pos = len(s.ids)
        eos_allowed = not params.ignore_eos and pos >= params.min_tokens
        if eos_allowed and pos >= s.natural_len:
            token = EOS_ID
        else:
            sentence_bytes = SENTENCE.encode("utf-8")
            token = sentence_bytes[(s.start + pos) % len(sentence_bytes)] + len(SPECIALS)
        s.ids.append(token)
        full = self.tokenizer.decode([t for t in s.ids if t != EOS_ID])
        if full.endswith("\ufffd"):
            full = full[:-1]  # hold back an incomplete UTF-8 character
        stop_reason: Any = None
        if token == EOS_ID:
            s.finish = "stop"
        for stop in params.stop_strings:
            at = full.find(stop)
            if at != -1 and s.finish is None:
                full = full[:at + (len(stop) if params.include_stop_str_in_output else 0)]
                s.finish, stop_reason = "stop", stop
        if s.finish is None and params.max_tokens is not None and len(s.ids) >= params.max_tokens:
            s.finish = "length"
        if s.finish is None and deadline is not None and time.time() > deadline:
            s.finish = "timeout"
        if s.finish is None and params.stop_strings:
            # hold back what could still become a stop string
            full = full[:max(s.text_len, len(full) - max(map(len, params.stop_strings)) + 1)]
        delta = full[s.text_len:] if len(full) > s.text_len else ""
        s.text_len = max(s.text_len, len(full))
        logprobs = None
        if params.logprobs is not None:
            tok_str = self.tokenizer.decode([token])
            alts = [len(SPECIALS) + (token + k) % 256 for k in range(params.logprobs)]
            tops = [TopLogprob(a, self.tokenizer.decode([a]), -0.5 * (k + 1))
                    for k, a in enumerate(alts)]
            logprobs = [TokenLogprob(token, tok_str, -0.25 - 0.01 * (pos % 7), tops)]
        return CompletionOutput(s.index, delta, [token], s.finish, stop_reason, logprobs,
                                num_tokens=len(s.ids))
