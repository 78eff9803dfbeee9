"""The engine's view of one sequence: tokens, progress, KV ownership and status (no torch)."""
from __future__ import annotations

import enum
import time
from typing import Optional

from llmserve.lora.registry import LoraRef, lora_cache_salt
from llmserve.pooling_params import PoolingParams
from llmserve.protocol import FinishReason, RequestMetrics
from llmserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"   # back in the waiting queue; its KV was freed, will be recomputed
    FINISHED = "finished"

    @property
    def is_waiting(self) -> bool:
        return self in (RequestStatus.WAITING, RequestStatus.PREEMPTED)


class Request:
    """One sequence in the engine.

    Token layout (positions)::

        | prompt_token_ids ............ | output_token_ids ...... |
        |<-- num_computed_tokens (KV written) -->|<- to compute ->|
                                                  ^ num_tokens - num_computed_tokens

    A step schedules `n` new tokens starting at `num_computed_tokens`; when the step
    reaches `num_tokens` the model samples one more token, which is appended.

    An embedding request (``pooling`` set) is prefill-only: it never samples and never
    decodes; the step that computes its last prompt token returns its pooled vector
    and the request finishes there (``max_total_tokens`` is its prompt length).
    """

    __slots__ = (
        "request_id", "prompt", "prompt_token_ids", "sampling_params", "priority",
        "arrival_time", "cache_salt", "output_token_ids", "all_token_ids",
        "num_computed_tokens", "num_cached_tokens", "status", "finish_reason",
        "stop_reason", "block_hashes", "num_preemptions", "last_preempted_step",
        "metrics", "eos_token_ids", "max_total_tokens", "deadline", "queue_deadline",
        "parent_id", "index", "spec_token_ids", "spec_state", "prompt_logprobs", "lora",
        "pooling",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        prompt: Optional[str] = None,
        priority: int = 1,
        arrival_time: Optional[float] = None,
        cache_salt: Optional[str] = None,
        eos_token_ids: frozenset[int] = frozenset(),
        max_model_len: int = 2048,
        deadline: Optional[float] = None,
        queue_deadline: Optional[float] = None,
        parent_id: Optional[str] = None,
        index: int = 0,
        lora: Optional[LoraRef] = None,
        pooling: Optional[PoolingParams] = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.priority = priority
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.lora = lora                      # the LoRA adapter it runs under (None: base)
        self.cache_salt = lora_cache_salt(cache_salt, lora)   # adapters never share KV
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1          # prompt tokens served by the prefix cache (-1: not yet looked up)
        self.status = RequestStatus.WAITING
        self.finish_reason: Optional[FinishReason] = None
        self.stop_reason: "Optional[str | int]" = None
        self.block_hashes: list[bytes] = []  # chained hashes of the full blocks of all_token_ids
        self.num_preemptions = 0
        self.last_preempted_step = -(10**9)
        self.metrics = RequestMetrics(arrival_time=self.arrival_time)
        self.eos_token_ids = eos_token_ids
        max_new = sampling_params.max_tokens
        limit = max_model_len if max_new is None else min(max_model_len, len(prompt_token_ids) + max_new)
        self.pooling = pooling                # set: an embedding request (prefill only)
        if pooling is not None:
            if pooling.method is None:
                raise ValueError("an embedding request needs its pooling method resolved")
            limit = len(prompt_token_ids)
        self.max_total_tokens = limit
        self.deadline = deadline              # time.time(): end the request then ("timeout")
        self.queue_deadline = queue_deadline  # time.time(): drop it if still unscheduled then
        self.parent_id = parent_id
        self.index = index
        # speculative decoding: draft tokens proposed for the next step (never part of
        # all_token_ids until the target model accepts them) and the per-request state of
        # spec_decode/decoder.py (None until the request speculates or brings a prediction)
        self.spec_token_ids: list[int] = []
        self.spec_state: object = None
        #: (logprob, top) of prompt tokens 1.. (prompt_logprobs requests), filled by steps
        self.prompt_logprobs: Optional[list] = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_embedding(self) -> bool:
        """A prefill-only request that returns a pooled vector instead of tokens."""
        return self.pooling is not None

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, priority={self.priority})"
        )
