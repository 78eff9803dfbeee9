"""Which model class runs which architecture: ``ModelConfig.architecture`` -> family class.

One file per family under ``llmserve.model.models``; a class is imported only when a model of
its family is loaded. Adding a family: write its file (a :class:`~.base.CausalLM` subclass),
add its HF name to ``config.SUPPORTED_ARCHITECTURES`` and a row here (docs/MODELS.md).
"""
from __future__ import annotations

import importlib

import torch

from llmserve.model.attention.backend import AttentionBackend
from llmserve.model.config import ModelConfig
from llmserve.model.layers.linear import LinearMethod
from llmserve.model.models.base import CausalLM, Shapes

#: architecture -> (module under llmserve.model.models, class name)
MODEL_FAMILIES: dict[str, tuple[str, str]] = {
    "llama": ("llama", "LlamaForCausalLM"),
    "mistral": ("llama", "LlamaForCausalLM"),
    "qwen2": ("llama", "LlamaForCausalLM"),
    "qwen3": ("llama", "LlamaForCausalLM"),
    "gemma2": ("gemma", "GemmaForCausalLM"),
    "gemma3": ("gemma", "GemmaForCausalLM"),
    "phi3": ("phi3", "Phi3ForCausalLM"),
    "mixtral": ("moe", "MoEForCausalLM"),
    "qwen2_moe": ("moe", "MoEForCausalLM"),
    "qwen3_moe": ("moe", "MoEForCausalLM"),
}


def model_class(architecture: str) -> type[CausalLM]:
    """The class that runs ``architecture``; ValueError lists the supported ones."""
    if architecture not in MODEL_FAMILIES:
        raise ValueError(f"no model class for architecture {architecture!r}; supported: "
                         f"{sorted(MODEL_FAMILIES)}")
    module, name = MODEL_FAMILIES[architecture]
    return getattr(importlib.import_module(f"llmserve.model.models.{module}"), name)


def build_model(cfg: ModelConfig, backend: AttentionBackend, method: LinearMethod,
                dtype: torch.dtype, device: torch.device, max_positions: int) -> CausalLM:
    """An unloaded model for ``cfg`` (weights come through ``load_weights``)."""
    return model_class(cfg.architecture)(cfg, backend, method, dtype, device, max_positions)


def expected_weight_shapes(cfg: ModelConfig) -> Shapes:
    """Every tensor (HF name) a checkpoint for ``cfg`` must hold, with its shape."""
    return model_class(cfg.architecture).expected_weight_shapes(cfg)
