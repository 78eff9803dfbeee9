"""Speculative-decoding verification: keep the drafts the target model agrees with.

A sequence with ``k`` draft tokens ``d_1 .. d_k`` arrives with ``k + 1`` logits rows: row
``j`` is the target's distribution for the position after ``d_j`` (row 0 after the last
committed token). Rows of one sequence are processed as if the drafts before them were
already output (penalties count them, ``min_tokens`` sees them), so each row's
distribution ``p_j`` is exactly what decoding without speculation would use there.

* greedy rows: ``d_{j+1}`` is accepted while it equals ``argmax p_j``; the first mismatch
  row (or the last row) contributes its argmax. Token-identical to greedy decoding.
* sampled rows (temperature, top-k, top-p, min-p applied to ``p`` as the sampler does):
  ``d_{j+1}`` is accepted with probability ``min(1, p_j(d) / q_j(d))``; at the first
  rejection a token is drawn from ``normalize(max(0, p_j - q_j))``, and when every draft
  is accepted from ``p_k``. ``q`` is the draft model's distribution, or one-hot on the
  draft for a deterministic proposer (n-gram, predictions): acceptance with probability
  ``p_j(d)``, and on rejection a draw from ``p_j`` with ``d`` removed. The output then
  follows the target distribution exactly.

Everything is batched over all rows of the step: one pass of penalties and filters, one
softmax, a ``[B, k_max]`` cumulative product for the accepted lengths and one inverse-CDF
draw per sequence. A sequence's uniforms come from its own generator when it is seeded
(``k + 1`` per step), so its tokens depend only on its seed, never on the batch.
"""
from __future__ import annotations

from typing import Collection, Optional, Sequence

import torch

from llmserve.engine.step_types import NonFiniteLogitsError, StepInput
from llmserve.model.sampling.sampler import Sampler, SamplingBatch, inverse_cdf_draw

Verified = tuple[list[list[int]], Optional[list[list[float]]], Optional[list[list[list]]]]


class ExtendedTokens(Sequence[int]):
    """``base + extra`` without copying ``base`` (a row's output plus earlier drafts)."""

    __slots__ = ("base", "extra")

    def __init__(self, base: Sequence[int], extra: Sequence[int]) -> None:
        self.base = base
        self.extra = extra

    def __len__(self) -> int:
        return len(self.base) + len(self.extra)

    def __getitem__(self, i):  # only for Sequence's protocol; iteration is what is used
        return list(self)[i]

    def __iter__(self):
        yield from self.base
        yield from self.extra


def verify_drafts(logits: torch.Tensor, step: StepInput, sampled: list[int],
                  generators: Sequence[Optional[torch.Generator]], sampler: Sampler,
                  eos_token_ids: Collection[int] = ()) -> Verified:
    """Accepted drafts plus one target token for each of ``step``'s ``sampled`` sequences.

    ``logits``: ``[sum(num_samples), vocab]``, the sampled sequences' rows in ``sampled``
    order. Returns (token ids, logprobs, top logprobs) per sequence, as StepOutput holds
    them. Raises NonFiniteLogitsError naming the sequences (indices into ``sampled``) with
    a row that has no finite logit, like the sampler.
    """
    dev = logits.device
    vocab = logits.shape[-1]
    offsets = [0]
    for n in step.num_new_tokens:
        offsets.append(offsets[-1] + n)
    counts, drafts, samp = [], [], []
    for i in sampled:
        ns = step.num_samples[i]
        end = offsets[i + 1]
        counts.append(ns)
        drafts.append(step.token_ids[end - ns + 1:end])
        samp.append(step.sampling[i])
    num_rows = sum(counts)
    starts = [0] * len(counts)
    for b in range(1, len(counts)):
        starts[b] = starts[b - 1] + counts[b - 1]
    draft_of_row = [t for d in drafts for t in (*d, 0)]
    seq_of_row = [b for b, c in enumerate(counts) for _ in range(c)]
    pos_of_row = [j for c in counts for j in range(c)]
    host = torch.tensor([draft_of_row, seq_of_row, pos_of_row], dtype=torch.int64).to(dev)
    draft_t, seq_t, pos_t = host[0], host[1], host[2]
    has_draft = pos_t < torch.tensor(counts, device=dev)[seq_t] - 1

    if all(s.params.plain_greedy and not s.params.min_tokens for s in samp):
        batch = None
        x = logits
        greedy_rows = None
    else:
        batch = SamplingBatch.build(
            [samp[b].params for b in seq_of_row],
            [samp[b].prompt_token_ids for b in seq_of_row],
            [ExtendedTokens(samp[b].output_token_ids, drafts[b][:j])
             for b, j in zip(seq_of_row, pos_of_row)],
            [None] * num_rows, vocab, dev, eos_token_ids)
        x = sampler.process_logits(logits, batch)
        greedy_rows = batch.greedy
    best = x.argmax(dim=-1)
    bad = ~torch.isfinite(x.amax(dim=-1))
    accept = best == draft_t
    probs = None
    if batch is not None and not batch.all_greedy:
        probs = torch.softmax(sampler.filter_logits(x, batch), dim=-1)
        saved = [(g, g.get_state()) for g in generators if g is not None]
        u, u_final = _uniforms(counts, starts, generators, sampler, dev)
        p_draft = probs.gather(1, draft_t.unsqueeze(1)).squeeze(1)
        q_rows = _draft_prob_rows(samp, counts, starts, num_rows, vocab, draft_t, dev)
        q_draft = (torch.ones_like(p_draft) if q_rows is None
                   else q_rows.gather(1, draft_t.unsqueeze(1)).squeeze(1))
        accept = torch.where(greedy_rows, accept, u * q_draft < p_draft)
    accept &= has_draft

    padded = torch.zeros(len(counts), max(counts), dtype=torch.int64, device=dev)
    padded[seq_t, pos_t] = accept.to(torch.int64)
    num_accepted = padded.cumprod(dim=1).sum(dim=1)
    final_row = torch.tensor(starts, device=dev) + num_accepted
    final = best[final_row]
    if probs is not None:
        final = _draw_final(probs, final_row, has_draft, draft_t, q_rows, u_final, best,
                            greedy_rows)
    # a bad row matters only up to each sequence's final row (later rows are discarded)
    bad &= pos_t <= num_accepted[seq_t]
    n_acc, final_l = torch.stack([num_accepted, final]).tolist()
    bad_l = bad.tolist()
    if any(bad_l):
        if probs is not None:  # undo the draws: a retry without the bad sequence
            for gen, state in saved:  # must draw what the good ones would have
                gen.set_state(state)
        rows = [r for r, v in enumerate(bad_l) if v]
        seqs = sorted({seq_of_row[r] for r in rows})
        raise NonFiniteLogitsError(f"cannot verify rows {rows}: their logits are NaN or all "
                                   f"-inf (e.g. every token masked by min_tokens)", rows=seqs)
    tokens = [list(d[:a]) + [f] for d, a, f in zip(drafts, n_acc, final_l)]
    if batch is None or batch.max_logprobs < 0:
        return tokens, None, None
    return (tokens, *_logprobs(logits, tokens, starts, draft_t, final_row, final, batch))


def _uniforms(counts, starts, generators, sampler: Sampler, dev
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """U[0, 1) per row (a draft's accept test) and per sequence (its final draw, which must
    not reuse a rejected row's number); a seeded sequence takes ``k + 2`` from its own."""
    rows, seqs = sum(counts), len(counts)
    seeded = [b for b, g in enumerate(generators) if g is not None]
    if len(seeded) < seqs:
        u = torch.rand(rows + seqs, dtype=torch.float64, device=dev,
                       generator=sampler.shared_generator(dev))
    else:
        u = torch.zeros(rows + seqs, dtype=torch.float64, device=dev)
    for b in seeded:
        own = torch.rand(counts[b] + 1, dtype=torch.float64, device=dev,
                         generator=generators[b])
        u[starts[b]:starts[b] + counts[b]] = own[:-1]
        u[rows + b] = own[-1]
    return u[:rows].to(torch.float32), u[rows:]


def _draft_prob_rows(samp, counts, starts, num_rows, vocab, draft_t, dev
                     ) -> Optional[torch.Tensor]:
    """``[rows, vocab]`` draft distributions: a draft model's rows as given, deterministic
    drafts one-hot; None when every draft is deterministic."""
    if all(s.draft_probs is None for s in samp):
        return None
    q = torch.zeros(num_rows, vocab, dtype=torch.float32, device=dev)
    for b, s in enumerate(samp):
        k = counts[b] - 1
        if k == 0:
            continue
        rows = slice(starts[b], starts[b] + k)
        if s.draft_probs is not None:
            q[rows] = s.draft_probs[:k, :vocab].to(dev, torch.float32)
        else:
            q[rows].scatter_(1, draft_t[rows].unsqueeze(1), 1.0)
    return q


def _draw_final(probs, final_row, has_draft, draft_t, q_rows, u_final, best, greedy_rows):
    """Each sequence's own token at its final row: from ``max(0, p - q)`` after a rejected
    draft, from ``p`` after accepting them all; argmax for greedy sequences."""
    p = probs[final_row]
    rejected = has_draft[final_row]
    d = draft_t[final_row].unsqueeze(1)
    if q_rows is None:
        q = torch.zeros_like(p).scatter_(1, d, 1.0)   # deterministic drafts: one-hot q
    else:
        q = q_rows[final_row]
    residual = torch.where(rejected.unsqueeze(1), (p - q).clamp_(min=0.0), p)
    mass = residual.sum(dim=1, keepdim=True)
    residual = torch.where(mass > 0, residual, p)   # p == q up to rounding: any draw is exact
    drawn = inverse_cdf_draw(residual, u_final)
    return torch.where(greedy_rows[final_row], best[final_row], drawn)


def _logprobs(logits, tokens, starts, draft_t, final_row, final, batch: SamplingBatch):
    """Raw-distribution logprobs of every emitted token (and top alternatives)."""
    raw = torch.log_softmax(logits.float(), dim=-1)
    chosen = draft_t.clone()
    chosen[final_row] = final
    values = raw.gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()
    lps = [values[s:s + len(t)] for s, t in zip(starts, tokens)]
    n_top = min(batch.max_logprobs, batch.vocab_size)
    if n_top <= 0:
        return lps, [[[] for _ in t] for t in tokens]
    top_v, top_i = raw.topk(n_top, dim=-1)
    top_v, top_i = top_v.tolist(), top_i.tolist()
    tops = []
    for s, t in zip(starts, tokens):
        want = batch.logprobs[s]
        tops.append([list(zip(top_i[r][:want], top_v[r][:want])) if want else []
                     for r in range(s, s + len(t))])
    return lps, tops
