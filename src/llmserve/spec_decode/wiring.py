"""Wires speculative decoding into an engine from its EngineConfig.

``--speculative-method ngram`` drafts by prompt lookup (spec_decode/proposers.py);
``draft`` runs a second, smaller model (spec_decode/draft_model.py, imported only then).
Without a method the engine still speculates for requests that bring a predicted output
(OpenAI Predicted Outputs), so a `SpeculativeDecoder` is always built.
"""
from __future__ import annotations

import logging
from typing import Any

from llmserve.config import EngineConfig
from llmserve.spec_decode.decoder import SpeculativeDecoder
from llmserve.spec_decode.proposers import NgramProposer

logger = logging.getLogger(__name__)


def build_speculation(config: EngineConfig, engine: Any) -> SpeculativeDecoder:
    """The engine's SpeculativeDecoder; ``engine`` is the LLMEngine being built (its
    tokenizer, runner and context length are ready)."""
    spec_cfg = config.spec_decode_config()
    proposer = None
    if config.speculative_method == "ngram":
        proposer = NgramProposer(spec_cfg.ngram_min, spec_cfg.ngram_max)
    elif config.speculative_method == "draft":
        from llmserve.spec_decode.draft_model import DraftModelProposer

        proposer = DraftModelProposer.build(config, engine)
    if proposer is not None:
        logger.info("speculative decoding: %s, k = %d%s, off above %d running sequences",
                    config.speculative_method, spec_cfg.num_speculative_tokens,
                    " (adaptive)" if spec_cfg.adaptive else "", spec_cfg.max_batch)
    return SpeculativeDecoder(spec_cfg, proposer)
