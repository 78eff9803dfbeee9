"""Mixture-of-experts MLP: top-k routing, then each expert runs once on all its tokens.

Per layer, for ``T`` tokens, ``E`` experts and ``k`` experts per token::

    scores   = softmax(router(x))                    (T, E) float32
    w, ids   = top-k(scores)                          (T, k)   [w /= sum(w) if normalised]
    order    = argsort(ids.flatten())                 the T*k (token, slot) pairs by expert
    rows     = x[order // k]                          tokens gathered, grouped by expert
    for each expert e with n_e > 0 tokens:            one batched MLP call per expert
        out[rows of e] = expert_e(rows of e)
    y        = index_add over tokens of out * w       back to token order

The only host sync is the per-expert token count (one ``bincount().tolist()``); the loop is
over experts that received tokens (at most ``min(E, T*k)``), never over tokens. Each expert
is a :class:`GatedMLP` of :class:`Linear` layers, so the engine's ``LinearMethod`` (dense,
int8, int4, GGUF-packed) holds expert weights like any other projection. The router stays
dense in the model dtype: routing decisions are sensitive to rounding.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from llmserve.model.layers.linear import DenseLinearMethod, Linear
from llmserve.model.loading.gguf import RawGGUFTensor
from llmserve.model.loading.int4_checkpoint import PackedInt4Tensor


class RouterLinearMethod(DenseLinearMethod):
    """Dense weights in the model dtype; a GGUF file's quantized router is dequantized."""

    def load_weight(self, layer: Linear, name: str,
                    tensor: "torch.Tensor | RawGGUFTensor | PackedInt4Tensor",
                    shard: Optional[int]) -> None:
        if isinstance(tensor, RawGGUFTensor):
            tensor = torch.from_numpy(tensor.dequantize())
        elif isinstance(tensor, PackedInt4Tensor):   # a GPTQ/AWQ router: dense too
            tensor = tensor.dequantize()
        super().load_weight(layer, name, tensor, shard)


class MoEMLP(nn.Module):
    """Routed experts (``experts``), optional always-on ``shared_expert`` with a sigmoid gate."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, normalise: bool,
                 make_expert: Callable[[], nn.Module], dtype: torch.dtype, device: torch.device,
                 shared_expert: Optional[nn.Module] = None) -> None:
        super().__init__()
        router_method = RouterLinearMethod()
        self.gate = Linear(hidden, num_experts, bias=False, method=router_method, dtype=dtype,
                           device=device)
        self.experts = nn.ModuleList(make_expert() for _ in range(num_experts))
        self.num_experts = num_experts
        self.top_k = top_k
        self.normalise = normalise
        self.shared_expert = shared_expert
        self.shared_expert_gate = None
        if shared_expert is not None:
            self.shared_expert_gate = Linear(hidden, 1, bias=False, method=router_method,
                                             dtype=dtype, device=device)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights (T, k) in x's dtype, expert ids (T, k))``."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.normalise:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        token_of = order // self.top_k
        rows = x.index_select(0, token_of)
        outs = torch.empty_like(rows)
        start = 0
        for expert, n in zip(self.experts, counts):
            if n:
                outs[start:start + n] = expert(rows[start:start + n])
                start += n
        outs = outs * weights.flatten().index_select(0, order).unsqueeze(-1)
        y = torch.zeros_like(x).index_add_(0, token_of, outs)
        if self.shared_expert is not None:
            y = y + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return y

