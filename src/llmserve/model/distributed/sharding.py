"""A tensor-parallel group's :class:`~llmserve.model.executor.sharding.RankSharding`: the
family's plan (:mod:`~llmserve.model.distributed.plans`) applied by the sharded layers
(:mod:`~llmserve.model.distributed.layers`)."""
from __future__ import annotations

import torch
from torch import nn

from llmserve.model.config import ModelConfig
from llmserve.model.distributed.group import TensorParallelGroup
from llmserve.model.distributed.layers import check_shardable, local_config, shard_model
from llmserve.model.distributed.plans import plan_for
from llmserve.model.layers.linear import LinearMethod


class GroupSharding:
    """This process's rank of ``group``."""

    def __init__(self, group: TensorParallelGroup) -> None:
        self.group = group
        self.device: torch.device = group.device
        self.world_size = group.world_size
        self.samples = group.rank == 0

    def local_config(self, config: ModelConfig) -> ModelConfig:
        return local_config(config, self.world_size)

    def shard(self, model: nn.Module, config: ModelConfig, method: LinearMethod) -> None:
        check_shardable(config, self.world_size, method)
        shard_model(model, config, self.group, plan_for(config.architecture, self.world_size))

    def agree_min(self, value: int) -> int:
        return self.group.agree_min(value)
