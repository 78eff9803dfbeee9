"""A thinking budget: a reasoning block closed after at most N tokens.

A request with a :class:`ReasoningBudget` may think (inside ``<think> ... </think>``, or
from its first token when the prompt opened the block) for ``max_tokens`` tokens; if the
block is still open then, the next tokens are forced to be the close marker's, one per
step (the sampler sees a mask that allows only that token), and the answer follows. A
model that closes the block itself before the budget is left alone, as is one that does
not open it (when opening is the model's choice).

:class:`BudgetTracker` keeps one request's progress between steps; each step looks only at
the tokens added since the last (O(new tokens)), so a step's work does not grow with the
length of the output. No torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence


@dataclass(frozen=True)
class ReasoningBudget:
    """``max_tokens`` reasoning tokens, then ``end_ids`` (the close marker's token ids) are
    forced. ``start_ids``: the open marker's ids when the model opens the block itself;
    empty when the prompt already opened it (the output starts inside)."""

    max_tokens: int
    end_ids: tuple[int, ...]
    start_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) \
                or self.max_tokens < 0:
            raise ValueError(f"the thinking budget must be an integer >= 0, got "
                             f"{self.max_tokens!r}")
        if not self.end_ids:
            raise ValueError("a thinking budget needs the token ids of the close marker")


def _overlap(out: Sequence[int], marker: tuple[int, ...]) -> int:
    """Length of the longest end of ``out`` that is a proper beginning of ``marker``."""
    for k in range(min(len(marker) - 1, len(out)), 0, -1):
        if tuple(out[len(out) - k:]) == marker[:k]:
            return k
    return 0


class BudgetTracker:
    """One request's place in its thinking budget (see the module docstring)."""

    def __init__(self, budget: ReasoningBudget) -> None:
        self.budget = budget
        self.start: Optional[int] = 0 if not budget.start_ids else None   # first reasoning token
        self.done = False          # closed (by the model or by force), or never opened
        self.scanned = 0           # the next window end to search for the close marker
        self.forcing_from: Optional[int] = None   # output length when forcing began
        self.forced_offset = 0     # marker tokens the model had written when forcing began

    def _opened(self, out: Sequence[int]) -> bool:
        """Whether the block is open; decides it once the output is long enough."""
        if self.start is not None:
            return True
        marker = self.budget.start_ids
        head = tuple(out[:len(marker)])
        if head != marker[:len(head)]:
            self.done = True            # the model answered without thinking
            return False
        if len(head) < len(marker):
            return False                # not decided yet
        self.start = len(marker)
        return True

    def forced_token(self, out: Sequence[int]) -> Optional[int]:
        """The token the next step must produce after output ``out``, or None (free)."""
        if self.done or not self._opened(out):
            return None
        end = self.budget.end_ids
        if len(out) + 1 < self.scanned:      # the output was rewound: search it again
            self.scanned, self.forcing_from = 0, None
        for i in range(max(self.scanned, (self.start or 0) + len(end)), len(out) + 1):
            if tuple(out[i - len(end):i]) == end:
                self.done = True
                return None
        self.scanned = len(out) + 1
        if self.forcing_from is None:
            if len(out) - (self.start or 0) < self.budget.max_tokens:
                return None
            self.forced_offset = _overlap(out, end)
            self.forcing_from = len(out)
        k = self.forced_offset + len(out) - self.forcing_from
        if k >= len(end):
            self.done = True
            return None
        return end[k]
