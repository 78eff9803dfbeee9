"""Wires speculative decoding into an engine from its EngineConfig.

``--speculative-method ngram`` drafts by prompt lookup (spec_decode/proposers.py);
``suffix`` by suffix decoding (spec_decode/suffix_proposer.py);
``draft`` runs a second, smaller model (spec_decode/draft_model.py, imported only then).
Without a method the engine still speculates for requests that bring a predicted output
(OpenAI Predicted Outputs), so a `SpeculativeDecoder` is always built.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from llmserve.config import EngineConfig
from llmserve.spec_decode.decoder import SpeculativeDecoder
from llmserve.spec_decode.proposers import NgramProposer
from llmserve.spec_decode.suffix_proposer import SuffixProposer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TargetModel:
    """What a draft model must match of the target it drafts for (built by ``LLMEngine``
    once the target's runner exists)."""

    tokenizer_fingerprint: str
    vocab_size: int                 # token ids the tokenizer can decode
    max_model_len: int
    eos_token_ids: frozenset[int]
    num_kv_blocks: int              # the draft's pool mirrors the target's block tables


def build_speculation(config: EngineConfig, target: TargetModel) -> SpeculativeDecoder:
    """The engine's SpeculativeDecoder for ``config.speculative``."""
    spec_cfg = config.speculative
    proposer = None
    if config.speculative.method == "ngram":
        proposer = NgramProposer(spec_cfg.ngram_min, spec_cfg.ngram_max)
    elif config.speculative.method == "suffix":
        proposer = SuffixProposer(spec_cfg.suffix_max_depth, spec_cfg.suffix_min_confidence,
                                  spec_cfg.suffix_cache_max_nodes)
    elif config.speculative.method == "draft":
        from llmserve.spec_decode.draft_model import DraftModelProposer

        proposer = DraftModelProposer.build(config, target)
    if proposer is not None:
        logger.info("speculative decoding: %s, k = %d%s, off above %d running sequences",
                    config.speculative.method, spec_cfg.num_speculative_tokens,
                    " (adaptive)" if spec_cfg.adaptive else "", spec_cfg.max_batch)
    return SpeculativeDecoder(spec_cfg, proposer)
