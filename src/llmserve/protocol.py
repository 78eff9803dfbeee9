"""Plain data types shared by the engine, the offline API and the server.

No torch and no HTTP here: these objects cross the seam between the engine core
(which runs the model) and everything that talks to users.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional


class FinishReason(enum.StrEnum):
    """Why a sequence stopped. Values are the OpenAI API strings where one exists; a member
    is its string (``FinishReason.STOP == "stop"``, ``str(...)`` and JSON give ``"stop"``)."""

    STOP = "stop"          # EOS, a stop token id or a stop string
    LENGTH = "length"      # max_tokens or the model's context reached
    ABORT = "abort"        # cancelled by the caller (client went away)
    TIMEOUT = "timeout"    # the request's deadline passed
    QUEUE_TIMEOUT = "queue_timeout"  # waited in the queue longer than allowed
    ERROR = "error"        # the model step failed on this request (see RequestFailedError)


class RequestFailedError(RuntimeError):
    """The engine could not run one request: the model step raised on it alone.

    The rest of the batch was not affected. ``error_id`` names the log record with the
    traceback; ``input_error`` is True when the failure came from the request's own input
    (a ValueError or OverflowError raised while preparing or sampling it), so a server
    answers 4xx rather than 500.
    """

    def __init__(self, message: str, *, error_id: str, input_error: bool = False) -> None:
        super().__init__(message)
        self.error_id = error_id
        self.input_error = input_error


#: Priority classes: a lower number is served first. Integers are accepted too.
PRIORITY_CLASSES: dict[str, int] = {"interactive": 0, "default": 1, "batch": 2}
#: Integer priorities must lie in [-PRIORITY_LIMIT, PRIORITY_LIMIT] (the scheduler mixes
#: them with float aging; a 400-digit integer would overflow there).
PRIORITY_LIMIT = 2**31 - 1


def priority_value(priority: "int | str | None") -> int:
    """Map a priority class name (or an int) to its integer rank; lower runs first."""
    if priority is None:
        return PRIORITY_CLASSES["default"]
    if isinstance(priority, bool):
        raise ValueError("priority must be a class name or an integer")
    if isinstance(priority, int):
        if not -PRIORITY_LIMIT <= priority <= PRIORITY_LIMIT:
            raise ValueError(f"priority must be in [-{PRIORITY_LIMIT}, {PRIORITY_LIMIT}], "
                             f"got {priority}")
        return priority
    if isinstance(priority, str) and priority in PRIORITY_CLASSES:
        return PRIORITY_CLASSES[priority]
    raise ValueError(
        f"unknown priority {priority!r}; use one of {sorted(PRIORITY_CLASSES)} or an integer"
    )


@dataclass
class TopLogprob:
    token_id: int
    token: str
    logprob: float


@dataclass
class TokenLogprob:
    """Log-probability of one sampled token plus the top-N alternatives (raw model distribution)."""

    token_id: int
    token: str
    logprob: float
    top_logprobs: list[TopLogprob] = field(default_factory=list)


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (time.time()) of one request's life in the engine."""

    arrival_time: float
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    finished_time: Optional[float] = None


@dataclass
class CompletionOutput:
    """One of the `n` completions of a request.

    In a final output (LLM.generate) `text`/`token_ids`/`logprobs` are cumulative.
    In a streamed output (AsyncLLM.generate) they hold only what is new since the last
    output for this index; `num_tokens` is always the cumulative count.
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: Optional[FinishReason] = None
    stop_reason: "Optional[str | int]" = None  # the stop string or token id that matched
    logprobs: Optional[list[TokenLogprob]] = None
    num_tokens: int = 0
    # Predicted Outputs (final output of a request that brought a prediction): predicted
    # tokens accepted by speculative verification, and the rest of the prediction
    accepted_prediction_tokens: Optional[int] = None
    rejected_prediction_tokens: Optional[int] = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @staticmethod
    def joined(parts: "list[CompletionOutput]") -> "CompletionOutput":
        """Consecutive deltas of one completion (several tokens a step) as one delta."""
        if len(parts) == 1:
            return parts[0]
        last = parts[-1]
        logprobs = None
        if any(p.logprobs is not None for p in parts):
            logprobs = [lp for p in parts for lp in (p.logprobs or [])]
        return CompletionOutput(
            index=last.index, text="".join(p.text for p in parts),
            token_ids=[t for p in parts for t in p.token_ids], finish_reason=last.finish_reason,
            stop_reason=last.stop_reason, logprobs=logprobs, num_tokens=last.num_tokens,
            accepted_prediction_tokens=last.accepted_prediction_tokens,
            rejected_prediction_tokens=last.rejected_prediction_tokens)


@dataclass
class RequestOutput:
    """What the engine reports about one request (final, or a streamed increment)."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    metrics: Optional[RequestMetrics] = None
    error: Optional[RequestFailedError] = None  # set when a completion ended with "error"
    #: prompt_logprobs requests, on the first output that has them: one entry per prompt
    #: token, None for the first (nothing precedes it)
    prompt_logprobs: Optional[list[Optional[TokenLogprob]]] = None
    #: embedding requests, on the final output: the pooled vector (``PoolingParams``)
    embedding: Optional[list[float]] = None


@dataclass
class EngineStats:
    """A snapshot of the engine, cheap to read from any thread."""

    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    kv_blocks_high_water: int = 0
    num_preemptions: int = 0
    num_aborted: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    prefix_query_tokens_by_tenant: dict[str, int] = field(default_factory=dict)
    prefix_hit_tokens_by_tenant: dict[str, int] = field(default_factory=dict)
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    num_steps: int = 0
    num_step_errors: int = 0       # steps whose model execution raised (culprits isolated)
    num_step_reruns: int = 0       # extra runs of (parts of) those steps to isolate them
    weight_bytes: int = 0          # model weights resident (packed formats at their size)
    kv_bytes_per_token: int = 0    # KV pool bytes per token slot (all layers, K and V, scales)
    spec_proposed_tokens_total: int = 0   # speculative draft tokens verified
    spec_accepted_tokens_total: int = 0   # ...and accepted
    spec_acceptance_lengths: list[int] = field(default_factory=list)  # [a]: steps accepting a
    grammar_mask_seconds_total: float = 0.0  # structured outputs: bitmask time (sync + masks)
    grammar_mask_steps_total: int = 0        # steps that masked at least one row
    grammar_mask_rows_total: int = 0         # constrained rows masked
    grammar_compile_seconds_total: float = 0.0
    grammar_cache_hits: int = 0
    grammar_cache_misses: int = 0
    block_size: int = 0                    # KV block size in tokens (0: unknown)
    max_loras: int = 0                     # LoRA slots (distinct adapters per step; 0: off)
    lora_running: list[str] = field(default_factory=list)  # adapters of running requests
    lora_waiting: list[str] = field(default_factory=list)  # adapters of queued requests
