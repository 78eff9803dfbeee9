"""SamplingParams refuses values the sampler cannot represent (no torch)."""
from __future__ import annotations

import pytest

from llmserve.protocol import PRIORITY_LIMIT, priority_value
from llmserve.sampling_params import SamplingParams


@pytest.mark.parametrize("kwargs,field", [
    ({"repetition_penalty": 1e-300}, "repetition_penalty"),   # 0 in float32 -> NaN logits
    ({"repetition_penalty": 0.001}, "repetition_penalty"),
    ({"repetition_penalty": 1e300}, "repetition_penalty"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -1e300}, "frequency_penalty"),
    ({"seed": 2**64, "temperature": 1.0}, "seed"),            # manual_seed overflows
    ({"seed": -(2**63) - 1, "temperature": 1.0}, "seed"),
    ({"temperature": 1e-300}, "temperature"),                 # 0 in float32: divide by 0
    ({"temperature": 1e300}, "temperature"),                  # inf in float32
    ({"stop_token_ids": [2**31]}, "stop_token_ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
])
def test_unrepresentable_values_are_refused(kwargs, field):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert str(info.value).startswith(field)


@pytest.mark.parametrize("kwargs", [
    {"seed": 2**64 - 1, "temperature": 1.0}, {"seed": -(2**63), "temperature": 1.0},
    {"repetition_penalty": 0.01}, {"repetition_penalty": 100.0},
    {"temperature": 0.0}, {"temperature": 1e-5}, {"temperature": 100.0},
    {"presence_penalty": -2.0, "frequency_penalty": 2.0},
])
def test_edges_of_the_ranges_are_accepted(kwargs):
    SamplingParams(**kwargs).validate()


def test_children_of_extreme_seeds_stay_in_range():
    for seed in (2**64 - 1, -(2**63)):
        p = SamplingParams(n=4, seed=seed, temperature=1.0)
        seeds = {p.child(i).seed for i in range(4)}
        assert len(seeds) == 4 and all(0 <= s < 2**63 for s in seeds)


def test_min_tokens_mask_that_leaves_no_token_is_refused():
    p = SamplingParams(min_tokens=2, stop_token_ids=[1, 2, 3])
    with pytest.raises(ValueError, match="every one of the 4 tokens"):
        p.check_masks(4, eos_token_ids={0})
    p.check_masks(5, eos_token_ids={0})                       # token 4 stays
    SamplingParams(stop_token_ids=[0, 1, 2, 3]).check_masks(4, {0})   # no min_tokens: no mask
    SamplingParams(min_tokens=1, stop_token_ids=[7, 8]).check_masks(4, {0})  # out of vocab


def test_integer_priority_is_bounded():
    assert priority_value(PRIORITY_LIMIT) == PRIORITY_LIMIT
    with pytest.raises(ValueError, match="priority"):
        priority_value(10**400)   # would overflow the scheduler's float aging
