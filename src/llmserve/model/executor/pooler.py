"""Pooling of embedding sequences: final hidden states -> one vector per request.

The runner hands each step's hidden states (one row per new token, laid out in the
runner's order, before the model's final norm) and that norm to :meth:`Pooler.pool`,
which takes the rows of the step's embedding sequences (``StepInput.pooling``) through
the norm -- the vectors are the final hidden states the LM head would read -- and pools:

* ``last``: the last row of the chunk that ends the prompt;
* ``cls``:  the first row of the chunk that starts at position 0;
* ``mean``: each chunk's row sum (float32), kept by its start position until the chunk
  that ends the prompt, then divided by the prompt length.

Partial state is keyed by the chunk's start position, so a step re-run after a failure
(engine/step_isolation.py) overwrites its own contribution instead of adding it twice,
and a chunk that starts at 0 (a first chunk, or a recompute after a preemption) drops
whatever an earlier attempt left. The finished vector is cut to ``dimensions`` and,
with ``normalize``, scaled to unit L2 norm; it leaves as a list of floats.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from llmserve.engine.step_types import SequencePooling, StepInput


class Pooler:
    """Per-request pooling state across prefill chunks (see the module docstring)."""

    def __init__(self) -> None:
        #: request id -> {chunk start: float32 row (cls) or row sum (mean)}
        self._partial: dict[str, dict[int, torch.Tensor]] = {}

    def release(self, request_id: str) -> None:
        """Forget a request's partial sums (finished or aborted)."""
        self._partial.pop(request_id, None)

    @property
    def num_pending(self) -> int:
        """Requests with partial state (0 once every embedding request has ended)."""
        return len(self._partial)

    def pool(self, hidden: torch.Tensor, step: StepInput, order: Sequence[int],
             row_starts: Sequence[int], norm: Callable[[torch.Tensor], torch.Tensor]
             ) -> dict[str, list[float]]:
        """The vectors of the step's embedding sequences whose prompt ends this step;
        ``hidden[row_starts[p]:...]`` are the rows of sequence ``order[p]``, and
        ``norm`` is the model's final norm (applied to the rows pooled, only)."""
        finished: dict[str, torch.Tensor] = {}
        for pos, i in enumerate(order):
            rid = step.request_ids[i]
            task = step.pooling.get(rid)
            if task is None:
                continue
            r0, n = row_starts[pos], step.num_new_tokens[i]
            vector = self._add_chunk(rid, task, hidden[r0:r0 + n], step.start_positions[i],
                                     norm)
            if vector is not None:
                finished[rid] = _finish(vector, task)
        if not finished:
            return {}
        rows = torch.stack(list(finished.values())).cpu().tolist()
        return dict(zip(finished, rows))

    def _add_chunk(self, rid: str, task: SequencePooling, rows: torch.Tensor, start: int,
                   norm: Callable[[torch.Tensor], torch.Tensor]) -> "torch.Tensor | None":
        method = task.params.method
        if method == "last":
            return norm(rows[-1:])[0].float() if task.finishes else None
        if start == 0:
            self._partial[rid] = {}
        parts = self._partial.get(rid)
        if parts is None:
            raise RuntimeError(f"{method} pooling of {rid}: a chunk at position {start} "
                               "without the chunks before it")
        if method == "cls":
            if start == 0:
                parts[0] = norm(rows[:1])[0].float()
        elif method == "mean":
            parts[start] = norm(rows).float().sum(0)
        else:
            raise ValueError(f"unknown pooling method {method!r}")
        if not task.finishes:
            return None
        self._partial.pop(rid, None)
        if method == "cls":
            return parts[0]
        total = sum(parts.values(), torch.zeros_like(rows[0], dtype=torch.float32))
        return total / (start + rows.shape[0])


def _finish(vector: torch.Tensor, task: SequencePooling) -> torch.Tensor:
    """Cut to ``dimensions``, then L2-normalize when asked (float32)."""
    dims = task.params.dimensions
    if dims is not None:
        vector = vector[:dims]
    if task.params.normalize:
        vector = torch.nn.functional.normalize(vector, p=2.0, dim=0)
    return vector
