"""Structured outputs: constraints as data (spec), their compilation (compiler) and the
per-sequence grammar state that produces token bitmasks (matchers). No torch; the runner
applies the bitmasks (llmserve.model.sampling.logits_processors). See docs/STRUCTURED_OUTPUTS.md."""
from llmserve.structured_output.spec import StructuredOutputSpec, UnsupportedGrammarError, check_spec

__all__ = ["StructuredOutputSpec", "UnsupportedGrammarError", "check_spec"]
