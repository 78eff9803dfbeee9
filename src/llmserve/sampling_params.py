"""Per-request sampling parameters, validated on construction (no torch)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

_MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    """How to pick tokens for one request.

    Filters apply to the logits in this order (see llmserve.model.sampler):
      1. penalties: repetition (on prompt + output tokens), then frequency and presence
         (on output tokens), all before temperature;
      2. `min_tokens`: EOS and stop token ids are masked until that many tokens exist;
      3. temperature (0 means greedy: argmax of the penalised logits, filters skipped);
      4. top-k, then top-p (nucleus, over the top-k survivors), then min-p (relative to
         the most likely surviving token);
      5. a draw from the renormalised distribution, with the request's own generator
         when `seed` is set (so the result does not depend on the rest of the batch).
    Reported logprobs are of the raw model distribution (log-softmax of the unprocessed logits).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1              # -1 (or None) disables
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
        self.validate()

    @property
    def stop_strings(self) -> list[str]:
        return self._stop_list

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

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
        if num("temperature", self.temperature) < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        top_p = num("top_p", self.top_p)
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        top_k = integer("top_k", self.top_k)
        if top_k == 0 or top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or at least 1, got {self.top_k}")
        if not 0.0 <= num("min_p", self.min_p) <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if num("repetition_penalty", self.repetition_penalty) <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not -2.0 <= num("presence_penalty", self.presence_penalty) <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= num("frequency_penalty", self.frequency_penalty) <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.seed is not None:
            integer("seed", self.seed)
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
            if integer("stop_token_ids[]", t) < 0:
                raise ValueError(f"stop_token_ids must be >= 0, got {t}")
        if self.logprobs is not None:
            lp = integer("logprobs", self.logprobs)
            if not 0 <= lp <= _MAX_LOGPROBS:
                raise ValueError(f"logprobs must be in [0, {_MAX_LOGPROBS}], got {lp}")

    def child(self, index: int) -> "SamplingParams":
        """Params of the index-th of `n` completions: n=1, and a distinct derived seed."""
        import dataclasses

        seed = None if self.seed is None else (self.seed + index * 1_000_003) % (2**63)
        return dataclasses.replace(self, n=1, seed=seed)
