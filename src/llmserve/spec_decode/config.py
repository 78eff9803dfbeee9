"""The speculative-decoding settings of an engine (no torch, no engine imports), so that
:mod:`llmserve.config` can build them without importing the engine."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SpecDecodeConfig:
    """How the engine speculates (see the module docstring)."""

    num_speculative_tokens: int = 4
    ngram_min: int = 1
    ngram_max: int = 4
    max_batch: int = 16
    min_acceptance: float = 0.2
    adaptive: bool = True

    def __post_init__(self) -> None:
        if not 1 <= self.num_speculative_tokens <= 64:
            raise ValueError(f"num_speculative_tokens must be in [1, 64], "
                             f"got {self.num_speculative_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}")
        if self.max_batch < 1:
            raise ValueError(f"speculative max_batch must be >= 1, got {self.max_batch}")
        if not 0 <= self.min_acceptance < 1:
            raise ValueError(f"min_acceptance must be in [0, 1), got {self.min_acceptance}")
