"""Typed, torch-free messages between the engine core and a model runner.

Every step the core turns the scheduler's decision into one :class:`StepInput`; the runner
answers with one :class:`StepOutput`. The runner never sees a ``Request``: everything it
needs is in these plain lists, so the fake runner of the engine tests, the real runner and
(later) tensor-parallel workers all speak the same types.

Layout of one step (sequences in the order the core lists them)::

    seq:          0        1            2
    token_ids:  [ t  |  t t t t  |  t t ]          flat, num_new_tokens[i] per sequence
    start:        17      0            40          tokens already in the KV cache
    context:      18      4            42          start + num_new_tokens
    num_samples:  1       0            1           0: a prefill chunk that ends mid-prompt
    block_tables: [..]    [..]         [..]        physical KV blocks covering `context`

A sequence with ``num_samples = k`` (k >= 1) samples from its last ``k`` positions: 1 for a
normal decode or the end of a prefill, k + 1 when k speculative draft tokens are verified.

An embedding sequence (prefill only) never samples: it is listed in ``StepInput.pooling``
with how to pool its positions; the step that ends its prompt answers with its vector in
``StepOutput.pooled`` (plain floats: no tensors cross this seam).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from llmserve.pooling_params import PoolingParams
from llmserve.sampling_params import SamplingParams


@dataclass
class SequenceSampling:
    """What the sampler needs about one sampling sequence (no tensors, no Request)."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]      # shared with the engine, never copied per step
    output_token_ids: Sequence[int]
    # speculative drafts (the sequence's last num_samples - 1 tokens) from a draft model:
    # its [k, vocab] distributions (runner-side object); None: a deterministic draft
    draft_probs: object = None


@dataclass(frozen=True)
class SequencePooling:
    """What the runner needs about one embedding sequence this step.

    ``params.method`` is resolved (never None). ``finishes``: this step computes the
    sequence's last prompt token, so its vector comes back in this step's output; an
    earlier chunk only contributes to it (mean pooling sums its rows; a chunk that
    starts at position 0 begins a fresh sum, e.g. after a preemption).
    """

    params: PoolingParams
    finishes: bool


@dataclass
class StepInput:
    """One forward pass: new tokens of every scheduled sequence plus how to sample them."""

    request_ids: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    start_positions: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)
    num_samples: list[int] = field(default_factory=list)
    sampling: list[Optional[SequenceSampling]] = field(default_factory=list)  # None: no sample
    finished_request_ids: list[str] = field(default_factory=list)  # state the runner may drop
    #: request id -> (top-k, target ids): score these prompt tokens (prompt_logprobs); target
    #: j is the prompt token after this step's token j, so it may cover fewer positions
    prompt_logprob_targets: dict[str, tuple[int, list[int]]] = field(default_factory=dict)
    #: per sequence: the LoRA adapter it runs under (a LoraRef; None: the base model)
    loras: list[Optional[object]] = field(default_factory=list)
    #: request id -> how to pool it: the embedding sequences of this step (num_samples 0)
    pooling: dict[str, SequencePooling] = field(default_factory=dict)

    def add(self, request_id: str, token_ids: Sequence[int], start: int, block_table: list[int],
            num_samples: int, sampling: Optional[SequenceSampling], lora: object = None) -> None:
        """Append one sequence; ``token_ids`` are its new tokens for this step."""
        if not token_ids:
            raise ValueError(f"sequence {request_id!r} has no new tokens")
        if num_samples < 0 or num_samples > len(token_ids):
            raise ValueError(f"num_samples {num_samples} out of range for {len(token_ids)} tokens")
        if (num_samples > 0) != (sampling is not None):
            raise ValueError("a sampling sequence needs its SequenceSampling, and only it")
        self.request_ids.append(request_id)
        self.token_ids.extend(token_ids)
        self.num_new_tokens.append(len(token_ids))
        self.start_positions.append(start)
        self.block_tables.append(block_table)
        self.num_samples.append(num_samples)
        self.sampling.append(sampling)
        self.loras.append(lora)

    @property
    def num_seqs(self) -> int:
        return len(self.request_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_decode_only(self) -> bool:
        """Every sequence computes exactly one token (the compiled fast path)."""
        return all(n == 1 for n in self.num_new_tokens)


class NonFiniteLogitsError(RuntimeError):
    """Some sequences of a step have no finite logit to sample from (NaN, or every token
    -inf): a broken adapter or an overflow. ``request_ids`` names them (the runner fills it
    in from the sampler's ``rows``), so the engine core fails exactly those and re-runs the
    rest of the step once, instead of bisecting the batch to find them."""

    def __init__(self, message: str, *, rows: Sequence[int] = (),
                 request_ids: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.rows = list(rows)
        self.request_ids = list(request_ids)


@dataclass
class StepOutput:
    """Sampled tokens of the sampling sequences, in StepInput order.

    ``token_ids[i]`` lists the tokens accepted for ``request_ids[i]`` (one without
    speculation); ``logprobs[i][j]`` / ``top_logprobs[i][j]`` go with ``token_ids[i][j]``.
    """

    request_ids: list[str] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)
    logprobs: Optional[list[list[float]]] = None
    top_logprobs: Optional[list[list[list[tuple[int, float]]]]] = None
    #: request id -> (first position scored, [(logprob, [(token, logprob) top-k])]), for
    #: the StepInput's prompt_logprob_targets
    prompt_logprobs: Optional[dict[str, tuple[int, list]]] = None
    # with the runner's LogitsCapture (the draft model, the quality eval, parity tests):
    # tensors, typed loosely to keep this module torch-free
    logits: object = None
    all_logits: Optional[dict] = None
    #: request id -> its embedding (float32 values as floats), for the StepInput's pooling
    #: sequences whose ``finishes`` was set
    pooled: dict[str, list[float]] = field(default_factory=dict)
