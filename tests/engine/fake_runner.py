"""A model runner stand-in for CPU scheduler tests: no torch, deterministic tokens."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

from llmserve.engine.scheduler import ScheduledRequest, SchedulerOutput


@dataclass
class FakeRunnerOutput:
    request_ids: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: None = None
    top_logprobs: None = None


class FakeRunner:
    """Emits token (sum of the sequence's tokens) % vocab, so outputs depend on the whole prefix."""

    def __init__(self, vocab: int = 1000, eos: int | None = None,
                 fail_if: Optional[Callable[[ScheduledRequest], Optional[Exception]]] = None
                 ) -> None:
        self.vocab = vocab
        self.steps: list[SchedulerOutput] = []
        self.released: list[str] = []
        self.fail_if = fail_if   # an item -> the exception a batch holding it raises, or None

    def execute(self, sched: SchedulerOutput, block_tables: dict[str, list[int]]):
        self.steps.append(sched)
        if self.fail_if is not None:
            for s in sched.scheduled:
                exc = self.fail_if(s)
                if exc is not None:
                    raise exc
        out = FakeRunnerOutput()
        for s in sched.scheduled:
            table = block_tables[s.request.request_id]
            need = -(-(s.start + s.num_new_tokens) // 4)
            if len(table) < need:
                raise AssertionError(f"block table too short for {s.request}")
            if s.samples:
                out.request_ids.append(s.request.request_id)
                out.token_ids.append(10 + sum(s.request.all_token_ids) % (self.vocab - 10))
        return out

    def release(self, request_id: str) -> None:
        self.released.append(request_id)


class CharTokenizer:
    """Token id = code point; enough for detokenizing fake outputs."""

    all_special_ids = frozenset()
    eos_token_ids = frozenset()

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)

    def encode(self, text, add_special_tokens: bool = True):
        return [ord(c) for c in text]
