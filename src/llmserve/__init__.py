"""llmserve: an LLM inference engine with a paged KV cache and continuous batching,
behind an OpenAI-compatible multi-tenant gateway.

    from llmserve import LLM, SamplingParams
    llm = LLM()                                  # the default model (SmolLM2-135M-Instruct)
    out = llm.generate(["Hello"], SamplingParams(max_tokens=16))
"""
from __future__ import annotations

__version__ = "0.1.0"

from llmserve.config import EngineConfig
from llmserve.protocol import CompletionOutput, RequestOutput
from llmserve.sampling_params import SamplingParams

__all__ = ["LLM", "AsyncLLM", "EngineConfig", "SamplingParams", "RequestOutput",
           "CompletionOutput", "__version__"]


def __getattr__(name: str):
    # LLM and AsyncLLM import torch; load them only when asked for.
    if name == "LLM":
        from llmserve.llm import LLM
        return LLM
    if name == "AsyncLLM":
        from llmserve.async_llm import AsyncLLM
        return AsyncLLM
    raise AttributeError(f"module 'llmserve' has no attribute {name!r}")
