"""The speculative-decoding settings of an engine (no torch, no engine imports): the
``speculative`` part of :class:`llmserve.config.EngineConfig` and the configuration of the
engine's :class:`~llmserve.spec_decode.decoder.SpeculativeDecoder`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

METHODS = (None, "ngram", "suffix", "draft")
DRAFT_QUANTIZATIONS = ("auto", "none", "int8", "int4")


@dataclass(frozen=True)
class SpecDecodeConfig:
    """How the engine speculates (docs/SPECULATIVE.md).

    ``method`` None still verifies the drafts a request brings (OpenAI Predicted Outputs);
    ``ngram`` drafts by prompt lookup, ``suffix`` by suffix decoding over the request's
    tokens and recent outputs (``suffix_*``), ``draft`` with ``draft_model`` (same
    tokenizer).
    """

    method: Optional[str] = None           # CLI --speculative-method
    draft_model: Optional[str] = None      # HF folder or .gguf of the draft (method "draft")
    draft_quantization: str = "auto"       # the draft's weights: auto | none | int8 | int4
    num_speculative_tokens: int = 4
    ngram_min: int = 1
    ngram_max: int = 4
    suffix_max_depth: int = 32             # longest match + draft path the suffix trees hold
    suffix_min_confidence: float = 0.1     # CLI --suffix-min-confidence
    suffix_cache_max_nodes: int = 200_000  # the global tree over recent outputs (0: off)
    max_batch: int = 16                    # CLI --speculative-max-batch
    min_acceptance: float = 0.2
    adaptive: bool = True                  # CLI --speculative-adaptive

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_method must be ngram, suffix or draft (or None); "
                             f"got {self.method!r}")
        if (self.method == "draft") != (self.draft_model is not None):
            raise ValueError("draft_model is required by speculative_method 'draft' and used "
                             "by nothing else")
        if self.draft_quantization not in DRAFT_QUANTIZATIONS:
            raise ValueError(f"draft_quantization must be one of auto, none, int8, int4; "
                             f"got {self.draft_quantization!r}")
        if not 1 <= self.num_speculative_tokens <= 64:
            raise ValueError(f"num_speculative_tokens must be in [1, 64], "
                             f"got {self.num_speculative_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}")
        if not 2 <= self.suffix_max_depth <= 256:
            raise ValueError(f"suffix_max_depth must be in [2, 256], got {self.suffix_max_depth}")
        if not 0 <= self.suffix_min_confidence <= 1:
            raise ValueError(f"suffix_min_confidence must be in [0, 1], "
                             f"got {self.suffix_min_confidence}")
        if self.suffix_cache_max_nodes < 0:
            raise ValueError(f"suffix_cache_max_nodes must be >= 0, "
                             f"got {self.suffix_cache_max_nodes}")
        if self.max_batch < 1:
            raise ValueError(f"speculative max_batch must be >= 1, got {self.max_batch}")
        if not 0 <= self.min_acceptance < 1:
            raise ValueError(f"min_acceptance must be in [0, 1), got {self.min_acceptance}")
