"""What a runner knows of tensor parallelism: how to cut its own model, nothing more.

:class:`~llmserve.model.executor.runner.ModelRunner` takes an optional
:class:`RankSharding`. Without one it runs the whole model; with one it builds the rank's
share (:meth:`RankSharding.local_config`), wraps the layers before loading
(:meth:`RankSharding.shard`) and sizes its KV pool like every other rank
(:meth:`RankSharding.agree_min`). Spawning ranks and broadcasting steps belong to the
executor (:mod:`llmserve.model.executor.executor`); the implementation lives in
:mod:`llmserve.model.distributed.sharding`.
"""
from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from llmserve.model.config import ModelConfig
from llmserve.model.layers.linear import LinearMethod


class RankSharding(Protocol):
    """One rank's share of a model split over ``world_size`` ranks."""

    device: torch.device
    world_size: int
    #: True on the rank that samples (rank 0); the others only join the collectives.
    samples: bool

    def local_config(self, config: ModelConfig) -> ModelConfig:
        """The shapes of this rank's share (heads, K/V heads, MLP width, vocab rows)."""
        ...

    def shard(self, model: nn.Module, config: ModelConfig, method: LinearMethod) -> None:
        """Wrap ``model``'s layers (built from :meth:`local_config`) into this rank's
        shard before its weights are loaded; ``config`` is the full model's."""
        ...

    def agree_min(self, value: int) -> int:
        """The smallest ``value`` over all ranks (one KV pool size for every rank)."""
        ...
