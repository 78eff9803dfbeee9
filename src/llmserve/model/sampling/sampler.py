"""Batched token sampling: penalties, min_tokens, temperature, top-k/top-p/min-p, seeded draws.

One `SamplingBatch` is built per engine step from the requests' `SamplingParams`; the
`Sampler` then turns a `[B, V]` logits tensor into one token per row with a handful of
whole-batch tensor ops, in the order documented on `SamplingParams`.

A draw is an inverse-CDF lookup: with the row's unnormalised weights ``w = exp(logits - max)``
and one uniform ``u`` per row, the token is the first index whose cumulative weight reaches
``(1 - u) * sum(w)``; a token of weight 0 (masked, -inf) can never be picked. Unseeded rows
take their uniforms from one shared generator in a single call; a seeded row takes its
uniform from its own generator, so its tokens depend only on its seed, its logits and its
parameters, never on the rest of the batch. Each draw consumes one number per row, not V.

Penalties are applied sparsely: only the (row, token) pairs that occur in the prompt or
output are touched, so their cost is O(tokens), not O(batch * vocab).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch

from llmserve.engine.step_types import NonFiniteLogitsError
from llmserve.model.sampling.batch import SamplingBatch
from llmserve.model.sampling.logits_processors import apply_logit_bias_, apply_token_bitmask_

__all__ = ["Sampler", "SamplerOutput", "SamplingBatch", "apply_penalties_",
           "apply_min_tokens_mask_", "apply_top_k_top_p_", "apply_min_p_", "row_logsumexp",
           "row_max"]

logger = logging.getLogger(__name__)

_NEG_INF = float("-inf")
# Top-p over the whole vocabulary first looks at this many most likely tokens; only when
# they do not reach top_p for some row does it sort the whole vocabulary.
_TOP_P_CANDIDATES = 1024
# torch.topk is used instead of a full sort while k is at most this fraction of the vocabulary.
_TOPK_FRACTION = 0.25
# row_max looks for a row's maximum in chunks of this many logits.
_ARGMAX_CHUNK = 1024


def row_max(x: torch.Tensor) -> "tuple[torch.Tensor, torch.Tensor]":
    """``x.max(dim=-1)`` of a 2-D float tensor: each row's maximum and its first index.

    PyTorch's CPU argmax is a scalar loop, much slower on a batch of vocabulary-wide rows
    than the vectorized ``amax`` (docs/BENCHMARKS.md). Wide rows are cut in chunks: ``amax``
    per chunk, the first chunk that reaches the row's maximum, and the first index in that
    chunk alone. A row holding a NaN has a NaN maximum (its index means nothing), as ``max``.
    """
    n, v = x.shape
    if v < 4 * _ARGMAX_CHUNK or x.stride(1) != 1 or x.device.type != "cpu":
        return x.max(dim=-1)
    full = v - v % _ARGMAX_CHUNK
    chunks = x[:, :full].view(n, full // _ARGMAX_CHUNK, _ARGMAX_CHUNK)
    chunk_max = chunks.amax(dim=-1)                                  # (n, chunks)
    values = chunk_max.amax(dim=-1)
    tail = x[:, full:]
    if full < v:
        values = torch.maximum(values, tail.amax(dim=-1))
    reached = chunk_max == values.unsqueeze(1)
    first = reached.to(torch.uint8).argmax(dim=-1)                   # first chunk at the max
    rows = torch.arange(n, device=x.device)
    index = chunks[rows, first].argmax(dim=-1) + first * _ARGMAX_CHUNK
    if full < v:   # a maximum only in the tail
        index = torch.where(reached.any(dim=-1), index, tail.argmax(dim=-1) + full)
    return values, index


def row_logsumexp(x: torch.Tensor) -> torch.Tensor:
    """``torch.logsumexp(x, dim=-1)`` of a 2-D float tensor, summed in the same order for a
    row whatever else is in ``x``: PyTorch splits a single wide row's sum between threads
    (another order than the same row's sum in a batch), so a seeded top-p draw depended on
    its batch. Wide rows are summed in chunks of :data:`_ARGMAX_CHUNK` (each chunk by one
    thread), then the chunk sums. Rows of -inf give -inf, as ``logsumexp``."""
    n, v = x.shape
    peak = x.amax(dim=-1, keepdim=True)
    shift = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    e = (x - shift).exp()
    if v < 4 * _ARGMAX_CHUNK or e.device.type != "cpu":
        total = e.sum(dim=-1)
    else:
        full = v - v % _ARGMAX_CHUNK
        total = e[:, :full].reshape(n, full // _ARGMAX_CHUNK, _ARGMAX_CHUNK).sum(dim=-1).sum(
            dim=-1)
        if full < v:
            total = total + e[:, full:].sum(dim=-1)
    return total.log() + shift.squeeze(1)


def apply_penalties_(logits: torch.Tensor, batch: SamplingBatch) -> None:
    """In place on a contiguous tensor: repetition (prompt + output), then frequency/presence.

    A seen token's logit is divided by the repetition penalty r when positive and multiplied
    by r otherwise; then logit -= frequency * output_count + presence * (output_count > 0).
    Only the seen (row, token) entries are read and written.
    """
    flat = logits.view(-1)
    if batch.repetition_index is not None:
        index, factor = batch.repetition_index, batch.repetition_factor
        values = flat[index]
        flat[index] = torch.where(values > 0, values / factor, values * factor)
    if batch.count_index is not None:
        flat[batch.count_index] = flat[batch.count_index] - batch.count_delta


def apply_min_tokens_mask_(logits: torch.Tensor, batch: SamplingBatch) -> None:
    """In place: -inf on the EOS / stop token entries of rows still under min_tokens."""
    if batch.banned_index is not None:
        logits.view(-1).index_fill_(0, batch.banned_index, _NEG_INF)


def apply_top_k_top_p_(logits: torch.Tensor, batch: SamplingBatch) -> None:
    """In place: keep each row's k largest logits, then the smallest prefix reaching top_p.

    Exactly k tokens survive top-k (ties broken by the sort). Top-p renormalises over the
    top-k survivors and keeps a token while the mass before it is below top_p, so at least
    one token survives. Rows with neither filter are left unchanged. Only the largest
    needed k (or `_TOP_P_CANDIDATES` for top-p alone) are ranked, unless those turn out
    not to reach top_p; then the whole vocabulary is sorted.
    """
    vocab = logits.shape[1]
    needed = batch.max_limited_k
    if batch.any_unlimited_top_p:
        needed = max(needed, _TOP_P_CANDIDATES)
    keep_sorted = None
    if needed <= vocab * _TOPK_FRACTION:
        values, index = logits.topk(needed, dim=-1)
        keep_sorted = _keep_ranked(logits, values, batch, complete=False)
    if keep_sorted is None:
        values, index = logits.sort(dim=-1, descending=True)
        keep_sorted = _keep_ranked(logits, values, batch, complete=True)
    keep = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, index, keep_sorted)
    keep |= ((batch.top_k >= vocab) & (batch.top_p >= 1.0)).unsqueeze(1)
    logits.masked_fill_(~keep, _NEG_INF)


def _keep_ranked(
    logits: torch.Tensor, values: torch.Tensor, batch: SamplingBatch, complete: bool
) -> Optional[torch.Tensor]:
    """Which of each row's ranked `values` survive top-k and top-p, or None if not decidable.

    `values` holds each row's largest logits in descending order: all of them when
    `complete`, else only the first few, which decides every row unless a top-p-only row's
    candidates hold less than top_p of its mass.
    """
    vocab = logits.shape[1]
    positions = torch.arange(values.shape[1], device=values.device)
    keep = positions.unsqueeze(0) < batch.top_k.unsqueeze(1)
    if not batch.needs_top_p:
        return keep
    masked = values.masked_fill(~keep, _NEG_INF)
    log_total = row_logsumexp(masked)
    unlimited = batch.top_k >= vocab
    if not complete and batch.any_unlimited_top_p:
        log_total = torch.where(unlimited, row_logsumexp(logits), log_total)
    probs = (masked - log_total.unsqueeze(1)).exp()
    cumulative = probs.cumsum(dim=-1)
    cutoff = torch.where(batch.top_p < 1.0, batch.top_p, torch.full_like(batch.top_p, 2.0))
    keep &= (cumulative - probs) < cutoff.unsqueeze(1)
    keep[:, 0] = True
    if not complete and batch.any_unlimited_top_p:
        short = unlimited & (batch.top_p < 1.0) & (cumulative[:, -1] < batch.top_p)
        if bool(short.any()):
            return None
    return keep


def apply_min_p_(logits: torch.Tensor, batch: SamplingBatch) -> None:
    """In place: drop tokens whose probability is below min_p times the row's largest.

    In logit space: p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p); log(0) = -inf
    keeps every token of rows without min-p.
    """
    threshold = logits.amax(dim=-1, keepdim=True) + torch.log(batch.min_p).unsqueeze(1)
    logits.masked_fill_(logits < threshold, _NEG_INF)


@dataclass
class SamplerOutput:
    """One step's result: a token per row and, when any row asked, raw-distribution logprobs."""

    token_ids: list[int]
    logprobs: Optional[list[float]] = None                       # chosen token's logprob
    top_logprobs: Optional[list[list[tuple[int, float]]]] = None  # per row, [] if not asked


class Sampler:
    """Picks one token per row of a logits tensor according to a `SamplingBatch`.

    `seed` initialises the shared generator used by rows without their own (one per device).
    """

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self._shared: dict[str, torch.Generator] = {}

    def shared_generator(self, device: torch.device) -> torch.Generator:
        """The generator unseeded rows draw from on `device`, created on first use."""
        key = str(device)
        gen = self._shared.get(key)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(self.seed)
            self._shared[key] = gen
        return gen

    @staticmethod
    def process_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Penalties, logit_bias, grammar masks and the min_tokens mask (steps 1-2), as
        float32; `logits` is not modified."""
        if not batch.needs_penalties and batch.banned_index is None and \
                batch.bias_index is None and batch.token_bitmask is None:
            return logits.float()
        x = logits.float() if logits.dtype != torch.float32 else logits.clone()
        apply_penalties_(x, batch)
        if batch.bias_index is not None:
            apply_logit_bias_(x, batch.bias_index, batch.bias_value)
        if batch.token_bitmask is not None:
            apply_token_bitmask_(x, batch.token_bitmask)
        apply_min_tokens_mask_(x, batch)
        return x

    @staticmethod
    def filter_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Temperature, top-k/top-p and min-p (steps 3-4) on processed logits, out of place."""
        x = logits / batch.temperature.unsqueeze(1)
        if batch.needs_top_k or batch.needs_top_p:
            apply_top_k_top_p_(x, batch)
        if batch.needs_min_p:
            apply_min_p_(x, batch)
        return x

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """Sample one token per row; raise RuntimeError for rows with no finite logit or NaN."""
        if logits.dim() != 2:
            raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
        if logits.shape[0] != batch.batch_size or logits.shape[1] != batch.vocab_size:
            raise ValueError(
                f"logits shape {tuple(logits.shape)} does not match the batch "
                f"({batch.batch_size} rows, vocab {batch.vocab_size})"
            )
        raw_logprobs = None
        if batch.max_logprobs >= 0:
            raw_logprobs = torch.log_softmax(logits.float(), dim=-1)

        x = self.process_logits(logits, batch)
        greedy_tokens = None
        if batch.any_greedy:
            values, greedy_tokens = row_max(x)
            peak = values.unsqueeze(1)
        else:
            peak = x.amax(dim=-1, keepdim=True)
        bad = ~torch.isfinite(peak.squeeze(1))
        if batch.all_greedy:
            tokens = greedy_tokens
        else:
            if batch.needs_top_k or batch.needs_top_p or batch.needs_min_p:
                filtered = self.filter_logits(x, batch)
                weights = (filtered - filtered.amax(dim=-1, keepdim=True)).exp_()
            else:  # max commutes with the positive temperature scaling
                weights = (x - peak).div_(batch.temperature.unsqueeze(1)).exp_()
            saved = [(g, g.get_state()) for g in (batch.generators[r] for r in batch.seeded_rows)]
            tokens = self._draw(weights, batch)
            if greedy_tokens is not None:
                tokens = torch.where(batch.greedy, greedy_tokens, tokens)

        token_ids, bad_rows = torch.stack([tokens, bad.to(tokens.dtype)]).tolist()
        if any(bad_rows):
            rows = [i for i, b in enumerate(bad_rows) if b]
            if not batch.all_greedy:  # undo the draws: a retry without the bad rows
                for gen, state in saved:  # must draw what the good rows would have
                    gen.set_state(state)
            raise NonFiniteLogitsError(
                f"cannot sample rows {rows}: their logits are NaN or all -inf "
                f"(e.g. every token masked by min_tokens)", rows=rows)
        if raw_logprobs is None:
            return SamplerOutput(token_ids=token_ids)
        return self._with_logprobs(token_ids, tokens, raw_logprobs, batch)

    def _draw(self, weights: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Inverse-CDF draw per row, proportional to `weights` (>= 0; masked tokens are 0)."""
        return inverse_cdf_draw(weights, self._uniforms(batch, weights.device))

    def _uniforms(self, batch: SamplingBatch, device: torch.device) -> torch.Tensor:
        """U[0, 1) per row: one shared batched draw, then each seeded row from its generator."""
        size = batch.batch_size
        if batch.any_unseeded_random:
            u = torch.rand(size, dtype=torch.float64, device=device,
                           generator=self.shared_generator(device))
        else:
            u = torch.zeros(size, dtype=torch.float64, device=device)
        for row in batch.seeded_rows:
            u[row] = torch.rand(1, dtype=torch.float64, device=device,
                                generator=batch.generators[row])[0]
        return u

    @staticmethod
    def _with_logprobs(
        token_ids: list[int],
        tokens: torch.Tensor,
        raw_logprobs: torch.Tensor,
        batch: SamplingBatch,
    ) -> SamplerOutput:
        chosen = raw_logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
        top: list[list[tuple[int, float]]] = [[] for _ in token_ids]
        n_top = min(batch.max_logprobs, batch.vocab_size)
        if n_top > 0:
            values, index = raw_logprobs.topk(n_top, dim=-1)
            values_l, index_l = values.tolist(), index.tolist()
            for row, want in enumerate(batch.logprobs):
                if want:
                    top[row] = list(zip(index_l[row][:want], values_l[row][:want]))
        return SamplerOutput(token_ids=token_ids, logprobs=chosen, top_logprobs=top)


def inverse_cdf_draw(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One index per row of ``weights (N, V)`` (>= 0, not all 0), drawn in proportion to
    them with the row's uniform ``u (N,)`` in [0, 1).

    The first index whose cumulative weight reaches a target in (0, total] always has a
    positive weight. The running sum is float64 so that rare tokens keep their share.
    """
    cdf = torch.cumsum(weights, dim=-1, dtype=torch.float64)
    target = (1.0 - u.to(cdf.device)) * cdf[:, -1]
    tokens = torch.searchsorted(cdf, target.unsqueeze(1)).squeeze(1)
    return tokens.clamp_(max=weights.shape[1] - 1)
