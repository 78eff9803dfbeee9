"""The contract between the HTTP server and the engine it serves.

The server never imports the engine (and so never imports torch): ``create_app``
receives any object that has the attributes and methods below. The real
implementation is the engine's ``AsyncLLM``; tests use a small fake.
"""
from __future__ import annotations

from typing import AsyncIterator, Optional, Protocol, Sequence, Union, runtime_checkable

from llmserve.protocol import EngineStats, RequestOutput
from llmserve.sampling_params import SamplingParams


@runtime_checkable
class TokenizerLike(Protocol):
    """The part of ``llmserve.tokenizer.Tokenizer`` the server uses.

    A tokenizer may also offer ``encode_chat(messages, add_generation_prompt=True)``
    returning token ids in which only the template's markers are control tokens; the
    server then uses it for chat prompts (so a user cannot inject ``<|im_start|>``).
    """

    eos_token_ids: Sequence[int]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special tokens (e.g. BOS) only when asked."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of a sequence of token ids."""
        ...

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True
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
    ) -> AsyncIterator[RequestOutput]:
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
