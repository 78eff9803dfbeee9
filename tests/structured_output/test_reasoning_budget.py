"""The thinking budget's tracker: which token a step must produce, from the output so far."""
from __future__ import annotations

import pytest

from llmserve.structured_output.reasoning_budget import BudgetTracker, ReasoningBudget

END = (90, 91, 92)
START = (80, 81)


def _drive(budget: ReasoningBudget, model: list[int], steps: int) -> list[int]:
    """Generate ``steps`` tokens: the forced one when there is one, else the model's next."""
    tracker, out, free = BudgetTracker(budget), [], iter(model)
    for _ in range(steps):
        forced = tracker.forced_token(out)
        out.append(forced if forced is not None else next(free))
    return out


def test_a_block_the_prompt_opened_is_closed_after_the_budget():
    out = _drive(ReasoningBudget(4, END), list(range(1, 50)), 10)
    assert out == [1, 2, 3, 4, 90, 91, 92, 5, 6, 7]


def test_a_model_that_closes_in_time_is_left_alone():
    model = [1, 2, 90, 91, 92, 7, 8, 9, 10, 11, 12]
    assert _drive(ReasoningBudget(5, END), model, 10) == model[:10]


def test_a_marker_begun_by_the_model_is_finished_not_repeated():
    out = _drive(ReasoningBudget(3, END), [1, 2, 90, 5, 6, 7, 8], 6)
    assert out == [1, 2, 90, 91, 92, 5]


def test_budget_zero_closes_at_once_and_opening_is_the_models_choice():
    assert _drive(ReasoningBudget(0, END), list(range(1, 9)), 5) == [90, 91, 92, 1, 2]
    opened = _drive(ReasoningBudget(2, END, START), [80, 81, 5, 6, 7, 8, 9], 7)
    assert opened == [80, 81, 5, 6, 90, 91, 92]
    assert _drive(ReasoningBudget(2, END, START), [5, 6, 7, 8, 9, 10], 6) == [5, 6, 7, 8, 9, 10]
    assert _drive(ReasoningBudget(1, END, START), [80, 3, 4, 5, 6], 5) == [80, 3, 4, 5, 6]


def test_a_rewound_output_is_searched_again():
    tracker = BudgetTracker(ReasoningBudget(3, END))
    assert tracker.forced_token([1, 2]) is None
    assert tracker.forced_token([1, 2, 3]) == 90
    assert tracker.forced_token([1]) is None          # rewound (recomputed from scratch)
    assert tracker.forced_token([1, 2, 3]) == 90


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_a_bad_budget_is_refused(bad):
    with pytest.raises(ValueError):
        ReasoningBudget(bad, END)
    with pytest.raises(ValueError):
        ReasoningBudget(2, ())
