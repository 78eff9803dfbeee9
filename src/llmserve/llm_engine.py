"""LLMEngine: builds the whole engine from an EngineConfig and speaks in user requests.

A user request with ``n`` completions becomes ``n`` engine sequences (ids ``rid``,
``rid#1`` ...) that share the prompt (and, with the prefix cache, its KV blocks); their
per-step deltas are folded back into one RequestOutput per user request.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

from llmserve import __version__
from llmserve.config import EngineConfig
from llmserve.default_model import resolve_model_path
from llmserve.engine.core import EngineCore, SequenceUpdate
from llmserve.engine.kv.kv_cache_manager import KVCacheManager
from llmserve.engine.kv.kv_events import KVEventLog, KVEventPublisher
from llmserve.engine.output.processor import OutputProcessor
from llmserve.engine.request import Request
from llmserve.engine.scheduler import Scheduler
from llmserve.lora.engine_loras import EngineLoras
from llmserve.pooling_params import PoolingParams
from llmserve.protocol import EngineStats, FinishReason, RequestOutput, TokenLogprob, priority_value
from llmserve.sampling_params import SamplingParams
from llmserve.spec_decode.wiring import TargetModel, build_speculation
from llmserve.structured_output.compiler import GrammarCompiler
from llmserve.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

PromptType = Union[str, Sequence[int]]


@dataclass
class UserRequest:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    children: list[str]
    num_cached_tokens: int = 0
    finished_children: set = field(default_factory=set)
    prompt_logprobs_sent: bool = False


class LLMEngine:
    """Synchronous engine: `add_request`, then call `step()` until nothing is left."""

    def __init__(self, config: EngineConfig, *, check_invariants: bool = False,
                 kv_events: Optional[KVEventPublisher] = None) -> None:
        """``kv_events``: where each step's KV-cache events go (``--kv-events-config``)."""
        import torch  # noqa: F401  (the runner needs it; imported here to keep errors early)

        from llmserve.model.executor.executor import RunnerArgs, build_executor
        from llmserve.model.loading.loader import open_checkpoint

        self.config = config
        self.model_path = resolve_model_path(config.model.path)
        t0 = time.time()
        ckpt = open_checkpoint(self.model_path)
        self.model_config = ckpt.config
        self.tokenizer = Tokenizer.from_path(self.model_path)
        model_len = ckpt.config.max_position_embeddings
        if config.model.max_model_len is not None:
            if config.model.max_model_len > model_len:
                raise ValueError(f"max_model_len {config.model.max_model_len} exceeds the model's "
                                 f"context of {model_len}")
            model_len = config.model.max_model_len
        eos = frozenset(self.tokenizer.eos_token_ids) | frozenset(ckpt.config.eos_token_ids)
        gen_eos = ckpt.generation_config.get("eos_token_id")
        if isinstance(gen_eos, int):
            eos |= {gen_eos}
        elif isinstance(gen_eos, list):
            eos |= set(gen_eos)
        self.eos_token_ids = eos
        # token ids the tokenizer can decode; a checkpoint's padded vocab rows are never sampled
        self.vocab_size = min(ckpt.config.vocab_size, self.tokenizer.vocab_size)
        #: one process or tensor-parallel ranks; ``runner`` is rank 0's (docs/ARCHITECTURE.md)
        self.executor = build_executor(config, ckpt, RunnerArgs(
            model_path=ckpt.path, max_model_len=model_len, eos_token_ids=eos,
            sample_vocab_size=self.vocab_size))
        self.runner = self.executor.runner
        #: structured-output grammars for this tokenizer (compiled off the engine thread by
        #: AsyncLLM; inline by a synchronous add_request)
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size, eos,
                                        json_whitespace=config.model.json_whitespace)
        self.dtype = str(self.runner.dtype).replace("torch.", "")
        self.kv_dtype = str(self.runner.kv_dtype).replace("torch.", "")
        pool_tokens = self.runner.num_blocks * config.cache.block_size
        if pool_tokens < model_len:
            logger.warning("max_model_len lowered from %d to %d tokens: the KV pool holds no more",
                           model_len, pool_tokens)
            model_len = pool_tokens
        self.max_model_len = model_len
        self.weights_fingerprint = ckpt.weights_fingerprint
        self.fingerprint = self._fingerprint(ckpt.config, self.weights_fingerprint)
        self.kv = KVCacheManager(self.runner.num_blocks, config.cache.block_size,
                                 config.cache.enable_prefix_caching, self.fingerprint,
                                 committed_blocks=self.runner.committed_blocks)
        self.kv_events = kv_events
        if kv_events is not None:
            self.kv.enable_events(KVEventLog(config.cache.block_size, kv_events.hashing))
            logger.info("KV events: block hashes %s; llmserve hash-chain root (no namespace) %s",
                        kv_events.hashing.mode, self.kv.root(None).hex())
        self.scheduler = Scheduler(config.scheduler, self.kv, max_loras=config.lora.max_loras,
                                   admission_watermark_blocks=max(1, self.runner.num_blocks // 100))
        self.spec = build_speculation(config, TargetModel(
            self.tokenizer.fingerprint, self.vocab_size, self.max_model_len,
            frozenset(self.eos_token_ids), self.runner.num_blocks))
        self.core = EngineCore(self.scheduler, self.executor, OutputProcessor(self.tokenizer),
                               check_invariants=check_invariants, spec=self.spec)
        self.model_name = _model_name(self.model_path)
        self.loras = EngineLoras(config, self.runner.lora, self.scheduler, self.model_name,
                                 self.fingerprint)   # LoRA adapters (docs/LORA.md)
        self.executor.warmup()
        self._requests: dict[str, UserRequest] = {}
        self._child_parent: dict[str, str] = {}
        logger.info("engine ready in %.1fs: %s (%s), fingerprint %s", time.time() - t0,
                    self.model_name, self.kv_dtype, self.fingerprint[:16])

    # ---- identity ----------------------------------------------------------------------
    def _fingerprint(self, mc, weights_fp: str) -> str:
        parts = {
            "engine": __version__,
            "architecture": mc.architecture,
            "model_config": {k: v for k, v in sorted(vars(mc).items()) if k != "eos_token_ids"},
            "weights": weights_fp,
            "quantization": {"file": mc.quantization, "runtime": self.runner.quantization},
            # which kernels compute (not their self-test log: kernel_plan.py)
            "kernels": {k: v for k, v in self.runner.kernel_plan.items()
                        if k not in ("native_kernels", "cpu")} | {
                "cpu_tier": self.runner.kernel_plan["cpu"]["tier"]},
            "tokenizer": self.tokenizer.fingerprint,
            "dtype": self.dtype,
            "kv_dtype": self.kv_dtype,
            "block_size": self.config.cache.block_size,
            # structured answers: the grammar options, so that a new bound on what
            # ``flexible`` allows is a new fingerprint too
            "json_whitespace": self.grammars.json_options,
            "pooling": self.config.model.pooling,                   # embeddings
        }
        blob = json.dumps(parts, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()

    @property
    def system_fingerprint(self) -> str:
        return "fp_" + self.fingerprint[:16]

    # ---- requests ----------------------------------------------------------------------
    def tokenize(self, prompt: PromptType) -> tuple[Optional[str], list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        ids = list(prompt)
        vocab = self.vocab_size
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise ValueError(f"token id {t!r} is not in the vocabulary [0, {vocab})")
        return None, ids

    def make_requests(
        self, request_id: str, prompt: PromptType, params: SamplingParams, *,
        priority: "int | str | None" = None, cache_salt: Optional[str] = None,
        arrival_time: Optional[float] = None, deadline: Optional[float] = None,
        queue_deadline: Optional[float] = None, prediction: Optional[str] = None,
        lora: Optional[str] = None,
    ) -> tuple[UserRequest, list[Request]]:
        """Validate and tokenize (thread-safe, touches no engine state). ``prediction``:
        the expected output text, drafted from by speculative decoding; ``lora``: the
        name of a loaded LoRA adapter to run under (LoraNotFound if none)."""
        lora_ref = self.loras.resolve(lora)
        if not isinstance(params, SamplingParams):
            raise TypeError("sampling_params must be a SamplingParams")
        params.check_masks(self.vocab_size, self.eos_token_ids)
        params = self.grammars.bind(params)   # cached, or compiled here (ValueError: bad spec)
        text, ids = self.tokenize(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        want = len(ids) + (params.max_tokens or 0)
        if len(ids) >= self.max_model_len or want > self.max_model_len:
            raise ValueError(
                f"prompt ({len(ids)} tokens) plus max_tokens ({params.max_tokens}) exceeds the "
                f"context length of {self.max_model_len} tokens")
        prio = priority_value(priority)
        arrival = time.time() if arrival_time is None else arrival_time
        children = []
        for i in range(params.n):
            cid = request_id if i == 0 else f"{request_id}#{i}"
            child = params.child(i) if params.n > 1 else params
            if i and child.prompt_logprobs is not None:  # the first child scores the prompt
                child = dataclasses.replace(child, prompt_logprobs=None)
            children.append(Request(
                cid, ids, child, prompt=text,
                priority=prio, arrival_time=arrival, cache_salt=cache_salt,
                eos_token_ids=self.eos_token_ids, max_model_len=self.max_model_len,
                deadline=deadline, queue_deadline=queue_deadline, parent_id=request_id,
                index=i, lora=lora_ref))
        if prediction is not None:
            if not isinstance(prediction, str):
                raise ValueError("prediction must be a string")
            pred_ids = self.tokenizer.encode(prediction, add_special_tokens=False)
            for c in children:
                c.spec_state = self.spec.prediction_state(c.request_id, pred_ids)
        user = UserRequest(request_id, text, ids, [c.request_id for c in children])
        return user, children

    @property
    def embedding_size(self) -> int:
        """Length of an embedding before ``dimensions`` cuts it: the hidden size."""
        return self.model_config.hidden_size

    def make_embedding_request(
        self, request_id: str, prompt: PromptType, pooling: Optional[PoolingParams] = None, *,
        priority: "int | str | None" = None, cache_salt: Optional[str] = None,
        arrival_time: Optional[float] = None, deadline: Optional[float] = None,
        queue_deadline: Optional[float] = None,
    ) -> tuple[UserRequest, list[Request]]:
        """An embedding request (prefill only; thread-safe, touches no engine state):
        the prompt may fill the whole context. ``pooling.method`` None takes the
        engine's ``--pooling``. ValueError for an empty or too long prompt, token ids
        outside the vocabulary or ``dimensions`` above the hidden size."""
        pooling = pooling or PoolingParams()
        if not isinstance(pooling, PoolingParams):
            raise TypeError("pooling must be a PoolingParams")
        if pooling.method is None:
            pooling = dataclasses.replace(pooling, method=self.config.model.pooling)
        if pooling.dimensions is not None and pooling.dimensions > self.embedding_size:
            raise ValueError(f"dimensions must be at most {self.embedding_size} (the model's "
                             f"hidden size), got {pooling.dimensions}")
        text, ids = self.tokenize(prompt)
        if not ids:
            raise ValueError("the input is empty")
        if len(ids) > self.max_model_len:
            raise ValueError(f"the input ({len(ids)} tokens) exceeds the context length of "
                             f"{self.max_model_len} tokens")
        request = Request(request_id, ids, SamplingParams(max_tokens=1), prompt=text,
                          priority=priority_value(priority),
                          arrival_time=time.time() if arrival_time is None else arrival_time,
                          cache_salt=cache_salt, max_model_len=self.max_model_len,
                          deadline=deadline, queue_deadline=queue_deadline,
                          parent_id=request_id, pooling=pooling)
        return UserRequest(request_id, text, ids, [request_id]), [request]

    def add_prepared(self, user: UserRequest, children: list[Request]) -> None:
        if user.request_id in self._requests:
            raise ValueError(f"request id {user.request_id!r} is already in the engine")
        taken = [c.request_id for c in children
                 if c.request_id in self.scheduler.requests or c.request_id in self._child_parent]
        if taken:  # check all before adding any: never leave an orphan child behind
            raise ValueError(f"request id(s) {taken} are already in the engine")
        for c in children:
            self.core.add_request(c)
            self._child_parent[c.request_id] = user.request_id
        self._requests[user.request_id] = user

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                    **kwargs) -> None:
        user, children = self.make_requests(request_id, prompt, params, **kwargs)
        self.add_prepared(user, children)

    def abort_request(self, request_id: str, reason: FinishReason = FinishReason.ABORT
                      ) -> Optional[RequestOutput]:
        """Abort a user request (all its completions). Returns its final output, if it existed."""
        user = self._requests.get(request_id)
        if user is None:
            return None
        updates = [u for cid in user.children
                   if (u := self.core.abort_request(cid, reason)) is not None]
        outs = self._fold(updates)
        return outs[0] if outs else None

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def step(self) -> list[RequestOutput]:
        """One engine step; returns the deltas of every user request that changed."""
        updates = self.core.expire_deadlines(time.time())
        updates += self.core.step()
        self._publish_kv_events()
        return self._fold(updates)

    def _publish_kv_events(self) -> None:
        """Hand the step's KV-cache events to the publisher (it sends them off-thread)."""
        log = self.kv.events
        if log is not None and log.events and self.kv_events is not None:
            self.kv_events.publish(log.take())

    def _fold(self, updates: list[SequenceUpdate]) -> list[RequestOutput]:
        by_parent: dict[str, RequestOutput] = {}
        for u in updates:
            pid = self._child_parent.get(u.request.request_id)
            if pid is None:
                continue
            user = self._requests[pid]
            out = by_parent.get(pid)
            if out is None:
                out = by_parent[pid] = RequestOutput(
                    request_id=pid, prompt=user.prompt, prompt_token_ids=user.prompt_token_ids,
                    outputs=[], metrics=u.request.metrics)
            if u.request.index == 0 and u.request.num_cached_tokens > 0:
                user.num_cached_tokens = u.request.num_cached_tokens
            if u.request.index == 0 and u.request.prompt_logprobs is not None \
                    and not user.prompt_logprobs_sent:
                user.prompt_logprobs_sent = True
                out.prompt_logprobs = self._prompt_logprobs(u.request)
            out.outputs.append(u.delta)
            if u.embedding is not None:
                out.embedding = u.embedding
            if u.error is not None:
                out.error = u.error
            if u.delta.finish_reason is not None:
                user.finished_children.add(u.request.request_id)
                self._child_parent.pop(u.request.request_id, None)
        for pid, out in by_parent.items():
            user = self._requests[pid]
            out.num_cached_tokens = user.num_cached_tokens
            if len(user.finished_children) == len(user.children):
                out.finished = True
                del self._requests[pid]
        return list(by_parent.values())

    def _prompt_logprobs(self, request: Request) -> list[Optional[TokenLogprob]]:
        """TokenLogprob of every prompt token but the first (None) from the step results."""
        entry = self.core.outputs.token_logprob
        out: list[Optional[TokenLogprob]] = [None]
        for token, (lp, top) in zip(request.prompt_token_ids[1:], request.prompt_logprobs):
            out.append(entry(token, lp, top))
        return out

    # ---- introspection -----------------------------------------------------------------
    def get_stats(self) -> EngineStats:
        """The core's counters plus each part's own (grammar compiles; masks in the runner)."""
        return dataclasses.replace(self.core.stats(), **self.grammars.as_engine_stats(),
                                   **self.runner.grammar_stats())

    def check_invariants(self) -> None:
        self.kv.check_invariants()

    def on_idle(self) -> None:
        """Called by a serving loop while no request runs: the executor's idle work (a
        finished background compile's graphs load now, not in the next request's step)."""
        self.executor.idle()

    def reset_prefix_cache(self, namespace: Optional[str] = None, *,
                           with_children: bool = False) -> int:
        """Forget cached prefixes: all, or one namespace's (``with_children``: and its
        ``namespace|...`` sub-namespaces). Pinned blocks keep their hashes. Returns how
        many block hashes were dropped."""
        dropped = self.kv.reset_prefix_cache(namespace, all_namespaces=namespace is None,
                                             with_children=with_children, keep_pinned=True)
        self._publish_kv_events()
        return dropped

    # ---- pinned prefixes and cache stats (call on the engine thread) -------------------
    @property
    def pin_limit_blocks(self) -> int:
        """Most blocks pins may hold at once: the pool minus one full-length request, so
        a request of ``max_model_len`` tokens always fits."""
        return max(0, self.kv.num_blocks - self.kv.blocks_needed(self.max_model_len))

    def pin_prefix(self, pin_id: str, token_ids: Sequence[int], cache_salt: Optional[str],
                   max_blocks: Optional[int] = None) -> int:
        """Pin the cached full blocks of ``token_ids`` (namespace ``cache_salt``), at most
        ``max_blocks`` and within :attr:`pin_limit_blocks`; returns how many were pinned."""
        pins = self.kv.pins
        room = self.pin_limit_blocks - pins.num_pinned_blocks + len(pins.blocks_of(pin_id))
        cap = max(0, room) if max_blocks is None else max(0, min(room, max_blocks))
        return pins.pin(pin_id, token_ids, self.kv.root(cache_salt), cap)

    def unpin_prefix(self, pin_id: str) -> int:
        """Release a pin; returns how many blocks it held (0 for an unknown id)."""
        return self.kv.pins.unpin(pin_id)

    def set_cache_audit_rate(self, rate: float) -> None:
        """Share of prefix-cache hits written to the ``llmserve.cache_audit`` log."""
        self.kv.hit_audit.set_sample_rate(rate)

    def cache_stats(self) -> dict:
        """Blocks used / cached / pinned, cached blocks and hit counters by namespace,
        the pins, and the hit audit's counters (JSON-ready)."""
        kv, prefix = self.kv, self.scheduler.prefix
        by_namespace: dict[str, int] = {}
        for block in kv.pool.cached.values():
            key = block.namespace or ""
            by_namespace[key] = by_namespace.get(key, 0) + 1
        audit = kv.hit_audit
        return {
            "blocks_total": kv.num_blocks, "blocks_used": kv.num_used_blocks,
            "blocks_free": kv.num_free_blocks, "blocks_cached": len(kv.pool.cached),
            "blocks_pinned": kv.pins.num_pinned_blocks, "pin_limit_blocks": self.pin_limit_blocks,
            "block_size": kv.block_size,
            "pins": {pin_id: len(ids) for pin_id, ids in kv.pins.items()},
            "cached_blocks_by_namespace": by_namespace,
            "prefix_tokens_by_namespace": {
                ns: {"queried": q, "hit": prefix.hit_by_tenant.get(ns, 0)}
                for ns, q in prefix.query_by_tenant.items()},
            "audit": {"sample_rate": audit.sample_rate, "hits": audit.hits,
                      "logged": audit.logged, "wrong_namespace_hits": audit.cross_namespace_hits},
        }


def _model_name(path: str) -> str:
    base = os.path.basename(os.path.normpath(path))
    if base.lower().endswith(".gguf"):
        base = base[:-5]
        for q in (".Q4_1", ".Q4_0", ".Q8_0", ".Q4_K_M", ".F16", ".F32"):
            if base.endswith(q):
                base = base[: -len(q)]
    return base or "model"
