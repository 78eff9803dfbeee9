"""Pure metrics of next-token distributions (torch tensors in, floats out).

    perplexity        exp(mean over positions of -log p(next token))
    top-1 agreement   share of positions where both configurations rank the same token first
    mean KL           mean over positions of KL(p_ref || p_test), in nats
    greedy agreement  per prompt, the share of the reference's greedy continuation that the
                      configuration reproduces before its first different token
"""
from __future__ import annotations

from typing import Sequence

import torch


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    """Float32 log-softmax over the last dimension."""
    return torch.log_softmax(logits.float(), dim=-1)


def mean_nll(logp: torch.Tensor, targets: torch.Tensor) -> float:
    """Mean negative log-likelihood of ``targets (N,)`` under ``logp (N, V)``."""
    if logp.shape[0] != targets.shape[0] or logp.shape[0] == 0:
        raise ValueError(f"need one target per row, got {logp.shape[0]} rows and "
                         f"{targets.shape[0]} targets")
    return float(-logp.gather(1, targets.view(-1, 1)).mean())


def top1_agreement(ref_logp: torch.Tensor, logp: torch.Tensor) -> float:
    return float((ref_logp.argmax(-1) == logp.argmax(-1)).float().mean())


def mean_kl(ref_logp: torch.Tensor, logp: torch.Tensor) -> float:
    """Mean KL(ref || test) over rows, in nats."""
    return float((ref_logp.exp() * (ref_logp - logp)).sum(-1).mean())


def greedy_agreement(reference: Sequence[Sequence[object]], other: Sequence[Sequence[object]]) -> float:
    """Mean over prompts of (tokens equal before the first difference) / reference length."""
    if len(reference) != len(other) or not reference:
        raise ValueError("need the same, non-zero number of continuations")
    shares = []
    for ref, got in zip(reference, other):
        same = 0
        for a, b in zip(ref, got):
            if a != b:
                break
            same += 1
        shares.append(same / max(1, len(ref)))
    return sum(shares) / len(shares)
