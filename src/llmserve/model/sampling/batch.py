"""The per-step sampling inputs: :class:`SamplingBatch`, built from the requests'
`SamplingParams` once per engine step (temperatures, top-k/p, min-p, penalty entries as
sparse (row, token) indices, seeded generators). The `Sampler` (model/sampling/sampler.py) consumes it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Optional, Sequence

import torch

from llmserve.sampling_params import SamplingParams


@dataclass
class SamplingBatch:
    """Per-row sampling parameters of one step, as tensors on the logits' device.

    Rows whose filters are disabled carry neutral values (top_k = vocab_size, top_p = 1,
    min_p = 0); greedy rows carry temperature 1 and neutral filters, and are resolved by argmax.
    Penalties are stored as flat ``row * vocab_size + token`` indices with per-entry values.
    """

    vocab_size: int
    temperature: torch.Tensor          # [B] float32 (1.0 on greedy rows)
    top_k: torch.Tensor                # [B] int64 (vocab_size where disabled)
    top_p: torch.Tensor                # [B] float32 (1.0 where disabled)
    min_p: torch.Tensor                # [B] float32 (0.0 where disabled)
    greedy: torch.Tensor               # [B] bool
    repetition_index: Optional[torch.Tensor]   # [N] int64: tokens seen in prompt or output
    repetition_factor: Optional[torch.Tensor]  # [N] float32: that row's repetition penalty
    count_index: Optional[torch.Tensor]        # [M] int64: tokens seen in the output
    count_delta: Optional[torch.Tensor]        # [M] float32: frequency * count + presence
    banned_index: Optional[torch.Tensor]       # [L] int64: EOS/stop ids masked for min_tokens
    generators: list[Optional[torch.Generator]]
    seeded_rows: list[int]             # sampled (non-greedy) rows that own a generator
    logprobs: list[Optional[int]]      # per row: None, or how many top alternatives
    all_greedy: bool
    any_greedy: bool
    any_unseeded_random: bool
    needs_top_k: bool
    needs_top_p: bool
    needs_min_p: bool
    max_limited_k: int                 # largest top_k < vocab_size among sampled rows (0: none)
    any_unlimited_top_p: bool          # a sampled row uses top-p without top-k
    max_logprobs: int                  # -1 when no row wants logprobs
    # set after build by model.logits_processors.LogitsAdjuster (None: no row asks)
    bias_index: Optional[torch.Tensor] = None     # [K] int64 flat row * vocab + token
    bias_value: Optional[torch.Tensor] = None     # [K] float32 logit_bias values
    token_bitmask: Optional[torch.Tensor] = None  # [B, ceil(V/32)] int32 grammar masks

    @property
    def batch_size(self) -> int:
        return len(self.generators)

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_index is not None or self.count_index is not None

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        generators: Sequence[Optional[torch.Generator]],
        vocab_size: int,
        device: "torch.device | str",
        eos_token_ids: Collection[int] = (),
    ) -> "SamplingBatch":
        """Gather the rows' parameters into tensors (O(B), plus O(tokens) only for penalties).

        `generators[i]` is row i's own generator (created by the caller from its seed and carried
        across steps) or None to use the sampler's shared one. While a row has fewer than
        `min_tokens` output tokens, `eos_token_ids` and its `stop_token_ids` are masked
        (also under `ignore_eos`, which only means EOS does not end the sequence), except
        under a grammar.
        """
        n = len(params)
        if n == 0:
            raise ValueError("cannot build a SamplingBatch with no rows")
        if not len(prompt_token_ids) == len(output_token_ids) == len(generators) == n:
            raise ValueError(
                "params, prompt_token_ids, output_token_ids and generators must have the same "
                f"length, got {n}, {len(prompt_token_ids)}, {len(output_token_ids)}, "
                f"{len(generators)}"
            )
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        device = torch.device(device)
        eos = {int(t) for t in eos_token_ids}

        temps, top_ps, min_ps, top_ks, greedy = [], [], [], [], []
        reps, freqs, presences = [], [], []
        banned: list[int] = []
        seeded_rows: list[int] = []
        logprobs: list[Optional[int]] = []
        any_unseeded_random = any_unlimited_top_p = False
        max_limited_k = 0
        max_logprobs = -1
        for i, p in enumerate(params):
            is_greedy = p.temperature == 0.0
            greedy.append(is_greedy)
            k = vocab_size if (p.top_k is None or p.top_k < 0) else min(p.top_k, vocab_size)
            if is_greedy:  # argmax: filters are skipped
                k, temp, top_p, min_p = vocab_size, 1.0, 1.0, 0.0
            else:
                temp, top_p, min_p = float(p.temperature), float(p.top_p), float(p.min_p)
            temps.append(temp)
            top_ks.append(k)
            top_ps.append(top_p)
            min_ps.append(min_p)
            if not is_greedy:
                if k < vocab_size:
                    max_limited_k = max(max_limited_k, k)
                elif p.top_p < 1.0:
                    any_unlimited_top_p = True
                if generators[i] is not None:
                    seeded_rows.append(i)
                else:
                    any_unseeded_random = True
            reps.append(float(p.repetition_penalty))
            freqs.append(float(p.frequency_penalty))
            presences.append(float(p.presence_penalty))
            # min_tokens never holds a grammar open: a complete grammar allows only EOS,
            # which min_tokens would mask too, leaving nothing to sample
            if (p.min_tokens and len(output_token_ids[i]) < p.min_tokens
                    and p.structured_output is None):
                base = i * vocab_size
                ids = eos.union(p.stop_token_ids or ())
                banned.extend(base + t for t in ids if 0 <= t < vocab_size)
            logprobs.append(p.logprobs)
            if p.logprobs is not None:
                max_logprobs = max(max_logprobs, p.logprobs)

        floats = torch.tensor([temps, top_ps, min_ps], dtype=torch.float32).to(device)
        ints = torch.tensor([top_ks, greedy], dtype=torch.int64).to(device)
        rep_index = rep_factor = count_index = count_delta = None
        rep_rows = [i for i, r in enumerate(reps) if r != 1.0]
        if rep_rows:
            seqs = [(i, prompt_token_ids[i]) for i in rep_rows]
            seqs += [(i, output_token_ids[i]) for i in rep_rows]
            index, _, rows = _token_entries(seqs, vocab_size)
            rep_index, rep_factor = index.to(device), torch.tensor(reps)[rows].to(device)
        count_rows = [i for i in range(n) if freqs[i] != 0.0 or presences[i] != 0.0]
        if count_rows:
            seqs = [(i, output_token_ids[i]) for i in count_rows]
            index, counts, rows = _token_entries(seqs, vocab_size)
            delta = torch.tensor(freqs)[rows] * counts + torch.tensor(presences)[rows]
            count_index, count_delta = index.to(device), delta.to(device)
        banned_index = torch.tensor(banned, dtype=torch.int64).to(device) if banned else None

        return cls(
            vocab_size=vocab_size,
            temperature=floats[0],
            top_k=ints[0],
            top_p=floats[1],
            min_p=floats[2],
            greedy=ints[1].bool(),
            repetition_index=rep_index,
            repetition_factor=rep_factor,
            count_index=count_index,
            count_delta=count_delta,
            banned_index=banned_index,
            generators=list(generators),
            seeded_rows=seeded_rows,
            logprobs=logprobs,
            all_greedy=all(greedy),
            any_greedy=any(greedy),
            any_unseeded_random=any_unseeded_random,
            needs_top_k=max_limited_k > 0,
            needs_top_p=any(tp < 1.0 for tp in top_ps),
            needs_min_p=any(mp > 0.0 for mp in min_ps),
            max_limited_k=max_limited_k,
            any_unlimited_top_p=any_unlimited_top_p,
            max_logprobs=max_logprobs,
        )


def _token_entries(
    seqs: list[tuple[int, Sequence[int]]], vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Distinct flat ``row * vocab_size + token`` indices over (row, token ids) pairs, on CPU.

    Returns (index [N] int64, occurrences [N] float32, row of each entry [N] int64).
    """
    ids: list[int] = []
    rows: list[int] = []
    lengths: list[int] = []
    for row, toks in seqs:
        ids.extend(toks)
        rows.append(row)
        lengths.append(len(toks))
    tok = torch.tensor(ids, dtype=torch.int64)
    if tok.numel() and (int(tok.min()) < 0 or int(tok.max()) >= vocab_size):
        raise ValueError(f"token ids must be in [0, {vocab_size}) for penalties")
    row = torch.repeat_interleave(torch.tensor(rows, dtype=torch.int64), torch.tensor(lengths))
    index, counts = torch.unique(row * vocab_size + tok, return_counts=True)
    return index, counts.to(torch.float32), index // vocab_size
