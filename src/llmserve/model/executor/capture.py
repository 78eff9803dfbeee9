"""Which logits a runner step hands back beside its tokens (``ModelRunner.capture``).

Serving captures nothing. The draft model of speculative decoding reads the distributions
of the rows it samples (``SAMPLED``: ``StepOutput.logits``); the quality eval
(``llmserve eval``) reads every scheduled position's (``ALL``: ``StepOutput.all_logits``,
which runs the step eagerly so every row's logits exist); parity tests read either. The
mode travels to tensor-parallel workers with each step, since all ranks must compute the
same rows.
"""
from __future__ import annotations

import enum


class LogitsCapture(enum.Flag):
    """What a step captures; members combine (``SAMPLED | ALL``)."""

    NONE = 0
    SAMPLED = enum.auto()   # the rows the step samples from, in the output's order
    ALL = enum.auto()       # every scheduled token's logits, per request
