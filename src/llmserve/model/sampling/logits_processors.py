"""Per-step logit adjustments from the requests: logit_bias and grammar masks (tensors).

:class:`LogitsAdjuster` is owned by the model runner. For each sampling step it gathers

* ``logit_bias`` of every row as flat ``row * vocab + token`` indices with values
  (O(biased tokens), like the penalties), and
* the token bitmask of every row with a structured-output grammar, filled on the host by
  :class:`llmserve.structured_output.matchers.GrammarMatchers` (int32 words, 32 tokens
  each; unconstrained rows all ones) and copied to the device in one transfer; a row
  whose thinking budget ran out (:mod:`llmserve.structured_output.reasoning_budget`)
  gets a mask that allows only the next token of the close marker,

and attaches them to the step's :class:`SamplingBatch`. Rows under a grammar drop their
``min_tokens`` mask (EOS is the only token a complete grammar allows). The sampler applies both in its
logit processing (:func:`apply_logit_bias_`, :func:`apply_token_bitmask_`): one
``index_add_`` and one masked fill over the whole batch, no loop over tokens.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from llmserve.structured_output.matchers import GrammarMatchers, bitmask_words
from llmserve.structured_output.reasoning_budget import BudgetTracker

_NEG_INF = float("-inf")


def apply_logit_bias_(logits: torch.Tensor, index: torch.Tensor, value: torch.Tensor) -> None:
    """In place on a contiguous float32 [B, V] tensor: ``logits.flat[index] += value``."""
    logits.view(-1).index_add_(0, index, value)


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: -inf where the row's bit is 0. ``bitmask`` is int32 [B, ceil(V / 32)] on the
    logits' device; bit ``t % 32`` of word ``t // 32`` allows token t."""
    rows, vocab = logits.shape
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(rows, -1)[:, :vocab]
    logits.masked_fill_(allowed == 0, _NEG_INF)


class LogitsAdjuster:
    """Builds the bias and mask tensors of a step; keeps the grammar state between steps."""

    def __init__(self, device: torch.device, num_threads: Optional[int] = None) -> None:
        self.device = device
        self.matchers = GrammarMatchers(num_threads)
        self._host: Optional[torch.Tensor] = None   # reused host buffer (pinned on CUDA)
        self._budgets: dict[str, BudgetTracker] = {}   # request id -> its thinking budget

    def release(self, request_id: str) -> None:
        self.matchers.release(request_id)
        self._budgets.pop(request_id, None)

    def _forced(self, rid: str, params, output_token_ids: Sequence[int]) -> Optional[int]:
        tracker = self._budgets.get(rid)
        if tracker is None or tracker.budget is not params.reasoning_budget:
            tracker = self._budgets[rid] = BudgetTracker(params.reasoning_budget)
        return tracker.forced_token(output_token_ids)

    def attach(self, batch, samplings: Sequence, request_ids: Sequence[str]) -> None:
        """Set ``batch.bias_index``/``bias_value``/``token_bitmask`` for the rows that ask."""
        vocab = batch.vocab_size
        index: list[int] = []
        values: list[float] = []
        grammar_rows = []
        forced: list[tuple[int, int]] = []
        for row, (s, rid) in enumerate(zip(samplings, request_ids)):
            p = s.params
            if p.reasoning_budget is not None:
                token = self._forced(rid, p, s.output_token_ids)
                if token is not None:
                    forced.append((row, token))
            if p.logit_bias:
                for token, bias in p.logit_bias.items():
                    if 0 <= token < vocab:
                        index.append(row * vocab + token)
                        values.append(float(bias))
            spec = p.structured_output
            if spec is not None:
                if spec.compiled is None:
                    raise ValueError(f"request {rid!r}: its structured output was not compiled "
                                     "by the engine")
                grammar_rows.append((row, rid, spec.compiled, s.output_token_ids))
        if index:
            batch.bias_index = torch.tensor(index, dtype=torch.int64).to(self.device)
            batch.bias_value = torch.tensor(values, dtype=torch.float32).to(self.device)
        if grammar_rows or forced:
            batch.token_bitmask = self._bitmask(grammar_rows, batch.batch_size, vocab, forced)

    def _bitmask(self, rows, batch_size: int, vocab: int,
                 forced: Sequence[tuple[int, int]] = ()) -> torch.Tensor:
        words = bitmask_words(vocab)
        host = self._host
        if host is None or host.shape[0] < batch_size or host.shape[1] != words:
            host = torch.empty((max(batch_size, 8), words), dtype=torch.int32,
                               pin_memory=self.device.type == "cuda")
            self._host = host
        view = host[:batch_size]
        view.fill_(-1)
        if rows:
            self.matchers.fill(rows, view.numpy())
        for row, token in forced:   # a budget that ran out: only the marker's next token
            view[row].zero_()
            bit = token % 32
            view[row, token // 32] = (1 << bit) - (1 << 32 if bit == 31 else 0)
        if self.device.type == "cpu":
            return view.clone()
        return view.to(self.device, non_blocking=True)

