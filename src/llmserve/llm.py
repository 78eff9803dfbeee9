"""Offline API: `LLM(model=None, **engine_args).generate(prompts, sampling_params)`."""
from __future__ import annotations

import itertools
from typing import Optional, Sequence, Union

from llmserve.config import EngineConfig
from llmserve.llm_engine import LLMEngine, PromptType
from llmserve.pooling_params import PoolingParams
from llmserve.protocol import CompletionOutput, RequestOutput
from llmserve.sampling_params import SamplingParams

Prompts = Union[PromptType, Sequence[PromptType]]


def _is_single_prompt(prompts: object) -> bool:
    if isinstance(prompts, str):
        return True
    return isinstance(prompts, (list, tuple)) and bool(prompts) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompts)


class LLM:
    """Run batches of prompts to completion through the continuous-batching engine.

    ``engine_args`` are the CLI's engine flags in snake case (see EngineConfig):
    dtype, device, block_size, kv_cache_gib, num_kv_blocks, max_num_seqs,
    max_num_batched_tokens, max_model_len, enable_prefix_caching, ...
    """

    def __init__(self, model: Optional[str] = None, **engine_args: object) -> None:
        check = bool(engine_args.pop("check_invariants", False))
        self.config = EngineConfig.from_kwargs(model=model, **engine_args)
        self.engine = LLMEngine(self.config, check_invariants=check)
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompts,
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        *,
        cache_salt: Union[None, str, Sequence[Optional[str]]] = None,
        priority: Union[None, int, str, Sequence[Union[int, str, None]]] = None,
        prediction: Union[None, str, Sequence[Optional[str]]] = None,
        lora: Union[None, str, Sequence[Optional[str]]] = None,
    ) -> list[RequestOutput]:
        """Complete every prompt (strings or token-id lists); outputs keep the input order.

        ``prediction``: the expected output text (per prompt, or one for all), replayed as
        speculative drafts (OpenAI Predicted Outputs; docs/SPECULATIVE.md). ``lora``: the
        LoRA adapter name (per prompt, or one for all; None: the base model)."""
        if _is_single_prompt(prompts):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        n = len(prompts)
        params = self._per_prompt(sampling_params or SamplingParams(), n, "sampling_params")
        salts = self._per_prompt(cache_salt, n, "cache_salt")
        prios = self._per_prompt(priority, n, "priority")
        preds = self._per_prompt(prediction, n, "prediction")
        loras = self._per_prompt(lora, n, "lora")
        # validate every prompt before any enters the engine
        prepared = [self.engine.make_requests(f"offline-{next(self._ids)}", prompt, p,
                                              cache_salt=salt, priority=prio, prediction=pred,
                                              lora=name)
                    for prompt, p, salt, prio, pred, name in zip(prompts, params, salts, prios,
                                                                 preds, loras)]
        for user, children in prepared:
            self.engine.add_prepared(user, children)
        return self._run([user.request_id for user, _ in prepared])

    def embed(self, prompts: Prompts, pooling_params: Optional[PoolingParams] = None, *,
              cache_salt: Optional[str] = None) -> list[list[float]]:
        """One embedding per prompt (a string or token ids), in input order: the final
        hidden states of the prompt pooled as ``pooling_params`` says (default: the
        engine's ``pooling``, L2-normalized). The prompts run through the engine as
        prefill-only requests, batched like any other (docs/EMBEDDINGS.md)."""
        if _is_single_prompt(prompts):
            prompts = [prompts]  # type: ignore[list-item]
        prepared = [self.engine.make_embedding_request(f"offline-{next(self._ids)}", prompt,
                                                       pooling_params, cache_salt=cache_salt)
                    for prompt in prompts]  # type: ignore[union-attr]
        for user, children in prepared:
            self.engine.add_prepared(user, children)
        outputs = self._run([user.request_id for user, _ in prepared])
        vectors = []
        for out in outputs:
            if out.error is not None:
                raise out.error
            if out.embedding is None:
                raise RuntimeError(f"request {out.request_id} ended without an embedding")
            vectors.append(out.embedding)
        return vectors

    def chat(
        self,
        messages: Union[list[dict], list[list[dict]]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        **kwargs,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or several) and generate."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        # the messages' text is never parsed for special tokens: only the template's are
        prompt_ids = [self.engine.tokenizer.encode_chat(c, add_generation_prompt=True)
                      for c in convs]  # type: ignore[arg-type]
        return self.generate(prompt_ids, sampling_params, **kwargs)

    def reset_prefix_cache(self, namespace: Optional[str] = None) -> int:
        return self.engine.reset_prefix_cache(namespace)

    def get_stats(self):
        return self.engine.get_stats()

    @staticmethod
    def _per_prompt(value, n: int, name: str) -> list:
        if isinstance(value, (list, tuple)):
            if len(value) != n:
                raise ValueError(f"{name}: got {len(value)} values for {n} prompts")
            return list(value)
        return [value] * n

    def _run(self, ids: list[str]) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        pending = set(ids)
        engine = self.engine
        stalled = 0
        while pending:
            if not engine.has_unfinished_requests():
                raise RuntimeError("engine stopped with requests pending")
            deltas = engine.step()
            stalled = 0 if deltas or engine.scheduler.running else stalled + 1
            if stalled > 1000:
                raise RuntimeError("the scheduler made no progress for 1000 steps")
            for delta in deltas:
                acc = results.get(delta.request_id)
                if acc is None:
                    acc = results[delta.request_id] = RequestOutput(
                        request_id=delta.request_id, prompt=delta.prompt,
                        prompt_token_ids=delta.prompt_token_ids, outputs=[])
                merge_delta(acc, delta)
                if delta.finished:
                    pending.discard(delta.request_id)
        for out in results.values():
            out.outputs.sort(key=lambda c: c.index)
        return [results[i] for i in ids]


def merge_delta(acc: RequestOutput, delta: RequestOutput) -> None:
    """Fold a streamed increment into a cumulative RequestOutput (in place)."""
    by_index = {c.index: c for c in acc.outputs}
    for d in delta.outputs:
        c = by_index.get(d.index)
        if c is None:
            c = CompletionOutput(index=d.index, logprobs=[] if d.logprobs is not None else None)
            acc.outputs.append(c)
            by_index[d.index] = c
        c.text += d.text
        c.token_ids.extend(d.token_ids)
        if d.logprobs is not None:
            if c.logprobs is None:
                c.logprobs = []
            c.logprobs.extend(d.logprobs)
        c.num_tokens = d.num_tokens or len(c.token_ids)
        if d.finish_reason is not None:
            c.finish_reason = d.finish_reason
            c.stop_reason = d.stop_reason
            c.accepted_prediction_tokens = d.accepted_prediction_tokens
            c.rejected_prediction_tokens = d.rejected_prediction_tokens
    acc.finished = delta.finished
    if delta.prompt_logprobs is not None:   # sent once, on the first output that has them
        acc.prompt_logprobs = delta.prompt_logprobs
    if delta.error is not None:
        acc.error = delta.error
    if delta.embedding is not None:
        acc.embedding = delta.embedding
    acc.num_cached_tokens = delta.num_cached_tokens
    acc.metrics = delta.metrics
