"""Grammar state of the running sequences and their token bitmasks, one batch per step.

:class:`GrammarMatchers` keeps one llguidance matcher per constrained sequence, keyed by
request id, together with how many of the sequence's output tokens it has consumed. Each
step :meth:`GrammarMatchers.fill` first brings every constrained row's matcher up to the
sequence's committed output tokens (O(new tokens): normally the one token sampled last
step), then computes all rows' next-token bitmasks in one call into llguidance's thread
pool, writing straight into a caller-owned int32 ``[rows, ceil(vocab / 32)]`` array
(bit ``t % 32`` of word ``t // 32`` set: token t allowed). The runner turns that array into
one batched masked fill of the logits.

The matcher follows the committed tokens, never the other way round, so it survives
whatever the engine does to a sequence: after preemption (recompute keeps the output
tokens) the state is reused, a lost or mismatched state is rebuilt from the committed
tokens, and fewer committed tokens than consumed (a rejected speculative draft) roll the
matcher back. A token the grammar refuses (EOS under ``ignore_eos`` after the grammar
ended, a ``stop_token_ids`` id) leaves the matcher in its error state, whose mask allows
only EOS. No torch.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Optional, Sequence

import numpy as np

logger = logging.getLogger(__name__)


def bitmask_words(vocab_size: int) -> int:
    """32-bit words per row of a token bitmask over ``vocab_size`` tokens."""
    return (vocab_size + 31) // 32


class _State:
    __slots__ = ("compiled", "matcher", "consumed")

    def __init__(self, compiled: Any) -> None:
        self.compiled = compiled
        self.matcher = compiled.new_matcher()
        self.consumed = 0


class GrammarMatchers:
    """Per-sequence matchers and batched bitmask filling (see module docstring)."""

    def __init__(self, num_threads: Optional[int] = None) -> None:
        self._num_threads = num_threads
        self._executor: Any = None
        self._states: dict[str, _State] = {}
        self.mask_seconds_total = 0.0     # wall time in fill(): sync + masks
        self.mask_rows_total = 0          # constrained rows masked
        self.mask_steps_total = 0         # steps with at least one constrained row
        self.rebuilds_total = 0           # states rebuilt from committed tokens

    def as_engine_stats(self) -> dict[str, float | int]:
        """The EngineStats fields of the masking counters."""
        return {"grammar_mask_seconds_total": self.mask_seconds_total,
                "grammar_mask_steps_total": self.mask_steps_total,
                "grammar_mask_rows_total": self.mask_rows_total}
    def __len__(self) -> int:
        return len(self._states)

    def release(self, request_id: str) -> None:
        """Forget a finished (or aborted) sequence's matcher."""
        self._states.pop(request_id, None)

    def _sync(self, request_id: str, compiled: Any, output: Sequence[int]) -> Any:
        state = self._states.get(request_id)
        if state is not None and state.compiled is not compiled:
            state = None
        n = len(output)
        if state is not None and n < state.consumed:
            if not state.matcher.rollback(state.consumed - n):
                state = None
            else:
                state.consumed = n
        if state is None:
            state = self._states[request_id] = _State(compiled)
            if n:
                self.rebuilds_total += 1
        if n > state.consumed:
            new = list(output[state.consumed:n])
            if not state.matcher.consume_tokens(new):
                logger.debug("sequence %s: a token left its grammar (%s); only EOS remains",
                             request_id, state.matcher.get_error())
            state.consumed = n
        return state.matcher

    def fill(self, rows: Sequence[tuple[int, str, Any, Sequence[int]]],
             bitmask: np.ndarray) -> None:
        """Write each ``(row, request_id, compiled_grammar, output_token_ids)``'s bitmask
        into ``bitmask[row]`` (int32, C-contiguous); other rows are left as they are."""
        if not rows:
            return
        if bitmask.dtype != np.int32 or bitmask.ndim != 2 or not bitmask.flags["C_CONTIGUOUS"]:
            raise ValueError("bitmask must be a C-contiguous int32 [rows, words] array")
        t0 = time.perf_counter()
        batch = []
        for row, request_id, compiled, output in rows:
            if not 0 <= row < bitmask.shape[0]:
                raise ValueError(f"row {row} outside the bitmask's {bitmask.shape[0]} rows")
            batch.append((self._sync(request_id, compiled, output), row))
        if self._executor is None:
            import llguidance

            self._executor = llguidance.LLExecutor(self._num_threads)
        self._executor.unsafe_compute_mask_ptr(batch, bitmask.ctypes.data,
                                               bitmask.shape[1] * 4, bitmask.shape[0])
        self.mask_seconds_total += time.perf_counter() - t0
        self.mask_rows_total += len(rows)
        self.mask_steps_total += 1
