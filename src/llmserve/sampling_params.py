"""Per-request sampling parameters, validated on construction (no torch)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Collection, Mapping, Optional, Sequence, Union

from llmserve.structured_output.reasoning_budget import ReasoningBudget
from llmserve.structured_output.spec import StructuredOutputSpec

_MAX_LOGPROBS = 20

#: Ranges that keep every value finite and exact enough in float32, where the sampler
#: applies them (a repetition penalty of 1e-300 rounds to 0 there and turns logits into
#: NaN; a temperature of 1e-300 divides by zero). See docs/GATEWAY.md, "Input limits".
TEMPERATURE_RANGE = (1e-5, 100.0)      # or exactly 0 (greedy)
REPETITION_PENALTY_RANGE = (0.01, 100.0)
PENALTY_RANGE = (-2.0, 2.0)            # presence_penalty, frequency_penalty (OpenAI's)
#: What ``torch.Generator.manual_seed`` accepts: a signed or unsigned 64-bit integer.
SEED_RANGE = (-(2**63), 2**64 - 1)
#: Token ids and priorities are stored in 32-bit-safe integers downstream.
MAX_TOKEN_ID = 2**31 - 1
#: OpenAI's range for logit_bias values (added to the logits).
LOGIT_BIAS_RANGE = (-100.0, 100.0)


@dataclass
class SamplingParams:
    """How to pick tokens for one request.

    Filters apply to the logits in this order (see llmserve.model.sampling.sampler):
      1. penalties: repetition (on prompt + output tokens), then frequency and presence
         (on output tokens), all before temperature;
      2. `logit_bias` is added, then the `structured_output` grammar masks every token it
         does not allow next, then `min_tokens` masks EOS and stop token ids until that
         many tokens exist; a `reasoning_budget` that ran out allows only the next token
         of the close marker;
      3. temperature (0 means greedy: argmax of the penalised logits, filters skipped);
      4. top-k, then top-p (nucleus, over the top-k survivors), then min-p (relative to
         the most likely surviving token);
      5. a draw from the renormalised distribution, with the request's own generator
         when `seed` is set (so the result does not depend on the rest of the batch).
    Reported logprobs are of the raw model distribution (log-softmax of the unprocessed logits).

    Validation keeps every value representable where the sampler uses it: temperature is
    0 or in [1e-5, 100], repetition_penalty in [0.01, 100], presence/frequency penalties
    in [-2, 2], seed in [-2**63, 2**64 - 1] (what torch's generators accept), token ids
    in [0, 2**31). Masks that would leave no token to sample (`min_tokens` with
    `stop_token_ids` covering the whole vocabulary) are refused by the engine, which
    knows the vocabulary (`check_masks`).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1              # -1, 0 or None disables (0 as in vLLM and transformers)
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: Optional[int] = None
    max_tokens: Optional[int] = 16   # None: up to the model's context
    min_tokens: int = 0
    stop: Union[None, str, Sequence[str]] = None
    stop_token_ids: Optional[Sequence[int]] = None
    ignore_eos: bool = False
    logprobs: Optional[int] = None   # None: no logprobs; 0: chosen token only; k: plus top-k
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: Optional[Mapping[int, float]] = None   # token id -> added to its logit
    structured_output: Optional[StructuredOutputSpec] = None
    reasoning_budget: Optional[ReasoningBudget] = None   # close <think> after N tokens
    prompt_logprobs: Optional[int] = None  # None: off; k: each prompt token's logprob + top-k
    _stop_list: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.top_k is None:
            self.top_k = -1
        if isinstance(self.stop, str):
            self._stop_list = [self.stop]
        elif self.stop is None:
            self._stop_list = []
        else:
            self._stop_list = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias is not None:
            self.logit_bias = dict(self.logit_bias) or None
        self.validate()

    @property
    def stop_strings(self) -> list[str]:
        return self._stop_list

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def plain_greedy(self) -> bool:
        """Greedy with no penalty and no logprobs: the argmax of the raw logits, unless
        ``adjusts_logits`` or ``min_tokens`` masks some of them."""
        return (self.temperature == 0.0 and self.logprobs is None
                and self.repetition_penalty == 1.0 and self.frequency_penalty == 0.0
                and self.presence_penalty == 0.0)

    @property
    def adjusts_logits(self) -> bool:
        """Whether logit_bias or a grammar changes this request's logits before sampling
        (such a request takes no greedy fast path and never speculates)."""
        return self.structured_output is not None or bool(self.logit_bias) \
            or self.reasoning_budget is not None

    def validate(self) -> None:
        """Raise ValueError naming the first invalid field."""

        def num(name: str, value: object) -> float:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{name} must be a number, got {value!r}")
            if math.isnan(value) or math.isinf(value):
                raise ValueError(f"{name} must be finite, got {value!r}")
            return float(value)

        def integer(name: str, value: object) -> int:
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an integer, got {value!r}")
            return value

        if integer("n", self.n) < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        temperature = num("temperature", self.temperature)
        low, high = TEMPERATURE_RANGE
        if temperature != 0.0 and not low <= temperature <= high:
            raise ValueError(f"temperature must be 0 (greedy) or in [{low:g}, {high:g}], "
                             f"got {self.temperature}")
        top_p = num("top_p", self.top_p)
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        top_k = integer("top_k", self.top_k)
        if top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (disabled) or at least 1, got {self.top_k}")
        if top_k == 0:
            self.top_k = -1
        if not 0.0 <= num("min_p", self.min_p) <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        low, high = REPETITION_PENALTY_RANGE
        if not low <= num("repetition_penalty", self.repetition_penalty) <= high:
            raise ValueError(f"repetition_penalty must be in [{low:g}, {high:g}], "
                             f"got {self.repetition_penalty}")
        low, high = PENALTY_RANGE
        if not low <= num("presence_penalty", self.presence_penalty) <= high:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not low <= num("frequency_penalty", self.frequency_penalty) <= high:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.seed is not None:
            low_seed, high_seed = SEED_RANGE
            if not low_seed <= integer("seed", self.seed) <= high_seed:
                raise ValueError(f"seed must be in [-2**63, 2**64 - 1], got {self.seed}")
        if self.max_tokens is not None and integer("max_tokens", self.max_tokens) < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if integer("min_tokens", self.min_tokens) < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        for s in self._stop_list:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            if not 0 <= integer("stop_token_ids[]", t) <= MAX_TOKEN_ID:
                raise ValueError(f"stop_token_ids must be in [0, 2**31), got {t}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= integer(name, value) <= _MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {_MAX_LOGPROBS}], got {value}")
        for t, bias in (self.logit_bias or {}).items():
            if not 0 <= integer("logit_bias", t) <= MAX_TOKEN_ID:
                raise ValueError(f"logit_bias keys must be token ids in [0, 2**31), got {t}")
            low, high = LOGIT_BIAS_RANGE
            if not low <= num("logit_bias", bias) <= high:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias}")
        if self.structured_output is not None and \
                not isinstance(self.structured_output, StructuredOutputSpec):
            raise ValueError("structured_output must be a StructuredOutputSpec")
        if self.reasoning_budget is not None:
            if not isinstance(self.reasoning_budget, ReasoningBudget):
                raise ValueError("reasoning_budget must be a ReasoningBudget")
            if self.structured_output is not None:
                raise ValueError("a thinking budget cannot be combined with structured "
                                 "outputs (response_format, forced tool calls)")

    def check_masks(self, vocab_size: int, eos_token_ids: Collection[int] = ()) -> None:
        """Raise ValueError when the min_tokens mask would leave no token to sample, or a
        logit_bias token id is outside the vocabulary.

        While fewer than `min_tokens` tokens exist, EOS (also under `ignore_eos`) and
        `stop_token_ids` are masked; if those cover every id in [0, vocab_size) no token
        could be drawn. The engine calls this with its vocabulary before accepting a request.
        """
        for t in self.logit_bias or {}:
            if t >= vocab_size:
                raise ValueError(f"logit_bias token id {t} is outside the vocabulary "
                                 f"[0, {vocab_size})")
        budget = self.reasoning_budget
        for t in (*budget.start_ids, *budget.end_ids) if budget is not None else ():
            if not 0 <= t < vocab_size:
                raise ValueError(f"the thinking budget's marker token {t} is outside the "
                                 f"vocabulary [0, {vocab_size})")
        if not self.min_tokens:
            return
        banned = {t for t in (*eos_token_ids, *self.stop_token_ids) if 0 <= t < vocab_size}
        if len(banned) >= vocab_size:
            raise ValueError(
                f"stop_token_ids with min_tokens={self.min_tokens} would mask every one of the "
                f"{vocab_size} tokens of the vocabulary (EOS and stop ids are masked until "
                f"min_tokens exist); leave at least one token unmasked")

    def child(self, index: int) -> "SamplingParams":
        """Params of the index-th of `n` completions: n=1, and a distinct derived seed."""
        import dataclasses

        seed = None if self.seed is None else (self.seed + index * 1_000_003) % (2**63)
        return dataclasses.replace(self, n=1, seed=seed)
