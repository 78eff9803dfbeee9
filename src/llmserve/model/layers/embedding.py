"""Token embedding and the LM head (which may share the embedding's weight)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.model.layers import cpu_kernels
from llmserve.model.layers.linear import Linear, LinearMethod


class VocabEmbedding(nn.Module):
    """``ids (T,) -> (T, hidden)`` lookup in a ``(vocab, hidden)`` table of the model dtype."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype, device=device),
                                   requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)

    def load(self, name: str, tensor: torch.Tensor, shard: object = None) -> None:
        if name != "weight" or tuple(tensor.shape) != tuple(self.weight.shape):
            raise ValueError(f"embedding {tuple(self.weight.shape)} cannot load {name} of shape "
                             f"{tuple(tensor.shape)}")
        self.weight.data.copy_(tensor)


class LMHead(nn.Module):
    """Float32 logits ``(N, vocab)``; its own Linear, or the embedding table when tied.

    A tied bf16 head on CPU multiplies with a oneDNN-packed copy of the table (the lookup
    needs the row-major table, the product is faster packed).
    """

    def __init__(self, vocab_size: int, hidden_size: int, *, tied_to: Optional[VocabEmbedding],
                 method: LinearMethod, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.tied = tied_to
        self.linear: Optional[Linear] = None
        if tied_to is None:
            self.linear = Linear(hidden_size, vocab_size, bias=False, method=method, dtype=dtype,
                                 device=device)
        self.vocab_size = vocab_size
        self.packed_id: Optional[int] = None

    def finish_loading(self, prepack: bool = True) -> None:
        if self.linear is None and prepack and cpu_kernels.can_prepack(self.tied.weight):
            self.packed_id = cpu_kernels.prepack_linear(self.tied.weight.data)

    @property
    def extra_bytes(self) -> int:
        """Bytes held beyond the embedding table (its own weight, or a packed copy)."""
        if self.linear is not None:
            return self.linear.weight_bytes
        return cpu_kernels.packed_bytes(self.packed_id) if self.packed_id is not None else 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.linear is not None:
            return self.linear(x).float()
        if self.packed_id is not None:
            return cpu_kernels.packed_linear(x, self.packed_id, self.vocab_size).float()
        return F.linear(x, self.tied.weight).float()

    def __del__(self) -> None:
        pid = self.__dict__.get("packed_id")
        if pid is not None:
            cpu_kernels.release(pid)
