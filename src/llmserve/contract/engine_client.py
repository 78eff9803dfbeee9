"""The contract between the HTTP server and the engine it serves.

The server and the gateway never import the engine (and so never import torch): they
receive any object that has the attributes and methods below. The real
implementation is the engine's ``AsyncLLM``; tests use a small fake.
"""
from __future__ import annotations

from typing import Any, AsyncGenerator, Optional, Protocol, Sequence, Union, runtime_checkable

from llmserve.pooling_params import PoolingParams
from llmserve.protocol import EngineStats, RequestOutput
from llmserve.sampling_params import SamplingParams


@runtime_checkable
class TokenizerLike(Protocol):
    """The part of ``llmserve.tokenizer.tokenizer.Tokenizer`` the server uses.

    A tokenizer may also offer ``encode_chat(messages, add_generation_prompt=True)``
    returning token ids in which only the template's markers are control tokens; the
    server then uses it for chat prompts (so a user cannot inject ``<|im_start|>``).
    """

    eos_token_ids: Sequence[int]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special tokens (e.g. BOS) only when asked."""
        ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of a sequence of token ids (special tokens dropped unless asked)."""
        ...

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render chat messages into a prompt string; raises ValueError on bad messages."""
        ...


@runtime_checkable
class EngineClient(Protocol):
    """What the server needs from an engine.

    Attributes:
        model_name: the served model name, e.g. ``"SmolLM2-135M-Instruct"``.
        fingerprint: a version string covering model, weights, quantization, tokenizer,
            chat template and engine version; returned as ``system_fingerprint``.
        max_model_len: the context length (prompt + output tokens) of one sequence.
        block_size: tokens per KV-cache block.
        tokenizer: the model's tokenizer (see :class:`TokenizerLike`).

    Threading: ``is_ready`` and ``get_stats`` are cheap and callable from any thread;
    ``generate`` and ``abort`` are called on the server's event loop.
    """

    model_name: str
    fingerprint: str
    max_model_len: int
    block_size: int
    tokenizer: TokenizerLike

    def is_ready(self) -> bool:
        """True once the engine can accept requests (model loaded, loop running)."""
        ...

    def get_stats(self) -> EngineStats:
        """A snapshot of queue sizes, KV usage and cumulative counters."""
        ...

    def generate(
        self,
        prompt: Union[str, list[int]],
        params: SamplingParams,
        request_id: str,
        *,
        priority: Union[int, str, None] = None,
        cache_salt: Optional[str] = None,
        deadline: Optional[float] = None,
        queue_deadline: Optional[float] = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream the request's progress as increments.

        Each yielded ``RequestOutput`` lists only the choices that changed; each
        ``CompletionOutput`` holds only the new text / token ids / logprobs, with
        ``num_tokens`` cumulative and ``finish_reason`` set on that choice's last
        increment. The last output has ``finished=True``, ``num_cached_tokens`` and
        ``metrics``. Invalid parameters raise ValueError before the first yield.
        Closing the iterator (``aclose``) or cancelling its consumer aborts the request.
        ``deadline`` is a ``time.time()`` wall-clock instant; when it passes the request
        ends with finish reason ``timeout``. ``queue_deadline`` (optional: the server
        passes it only to engines whose ``generate`` accepts it) drops a request that
        was not scheduled by then, with finish reason ``queue_timeout``.
        """
        ...

    async def abort(self, request_id: str) -> Optional[RequestOutput]:
        """Abort a request; must be idempotent and ignore unknown ids.

        May return the request's final output once its KV blocks are free (AsyncLLM
        does, also for an abort its stream's closing already sent): the server then
        bills from its ``metrics.first_scheduled_time`` and times the wait
        (``llmserve_cancel_to_kv_freed_seconds``). Returning None is allowed.
        """
        ...


# ---- optional capabilities: an engine has them or not (``isinstance`` tells) -------------
@runtime_checkable
class PrefixPinning(Protocol):
    """Engines that keep a prefilled prefix's KV blocks out of eviction (prompt bundles)."""

    async def pin_prefix(self, pin_id: str, token_ids: Sequence[int], cache_salt: Optional[str],
                         max_blocks: Optional[int] = None) -> int:
        """Pin up to ``max_blocks`` cached full blocks of ``token_ids`` under ``pin_id``;
        returns the blocks pinned (0 when the prefix is not cached)."""
        ...

    async def unpin_prefix(self, pin_id: str) -> int:
        """Release a pin; returns the blocks it held."""
        ...


@runtime_checkable
class EmbeddingEngine(Protocol):
    """Engines that serve ``/v1/embeddings``: prefill-only requests whose final output
    carries the pooled vector (``RequestOutput.embedding``)."""

    #: length of an embedding before ``dimensions`` cuts it (the model's hidden size)
    embedding_size: int
    #: the default pooling method: "last", "mean" or "cls"
    pooling: str

    def embed(
        self, prompt: list[int], pooling: Optional[PoolingParams], request_id: str, *,
        priority: Union[int, str, None] = None, cache_salt: Optional[str] = None,
        deadline: Optional[float] = None, queue_deadline: Optional[float] = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yield the request's one final output (``embedding`` set unless it ended
        otherwise: ``timeout``, ``queue_timeout``, ``abort``). Invalid input raises
        ValueError before the first yield; closing the iterator aborts the request;
        ``abort(request_id)`` works as for ``generate``."""
        ...


@runtime_checkable
class PrefixCacheAdmin(Protocol):
    """Engines whose prefix cache an operator may inspect and flush."""

    async def flush_prefix_cache(self, namespace: Optional[str] = None, *,
                                 with_children: bool = False) -> int:
        """Forget cached prefixes (all, or one namespace and optionally its children);
        returns the blocks dropped."""
        ...

    async def cache_stats(self) -> dict[str, Any]:
        """Blocks used / cached / pinned and prefix hit counters per namespace."""
        ...


@runtime_checkable
class KernelPlanReport(Protocol):
    """Engines that say which kernel runs each operation (``GET /v1/status``)."""

    def kernel_plan(self) -> dict[str, Any]:
        """The plan decided at start-up: plain JSON values (model/executor/kernel_plan.py)."""
        ...


@runtime_checkable
class LoraAdmin(Protocol):
    """Engines that serve LoRA adapters and load or unload them at run time."""

    def lora_adapters(self) -> list[dict[str, Any]]:
        """The loaded adapters, each described as a dict (name, path, rank, content_hash)."""
        ...

    async def load_lora_adapter(self, name: str, path: str) -> dict[str, Any]:
        """Load and register an adapter; returns its description."""
        ...

    async def unload_lora_adapter(self, name: str) -> None:
        """Unregister an adapter (raises while a request still uses it)."""
        ...


@runtime_checkable
class LoraEngineClient(EngineClient, LoraAdmin, Protocol):
    """An engine client that also serves LoRA adapters."""
