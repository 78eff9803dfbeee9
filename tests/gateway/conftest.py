"""Fixtures shared by the gateway tests."""
from __future__ import annotations

import pytest


class FakeClock:
    """A clock that only moves when told to: ``clock()`` reads it, ``clock.advance(s)`` moves it."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()
