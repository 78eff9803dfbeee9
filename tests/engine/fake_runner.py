"""A model runner stand-in for CPU scheduler tests: no torch, deterministic tokens.

It speaks the same typed step messages (StepInput -> StepOutput) as the real runner.
"""
from __future__ import annotations

from typing import Callable, Optional

from llmserve.engine.step_types import StepInput, StepOutput


class FakeRunner:
    """Emits token (sum of the sequence's tokens) % vocab, so outputs depend on the whole prefix."""

    def __init__(self, vocab: int = 1000, eos: int | None = None, block_size: int = 4,
                 fail_if: Optional[Callable[[str], Optional[Exception]]] = None) -> None:
        self.vocab = vocab
        self.block_size = block_size
        self.steps: list[StepInput] = []
        self.pool_sums: dict[str, int] = {}   # embedding requests: token sums so far
        self.released: list[str] = []
        self.fail_if = fail_if   # a request id -> the exception a batch holding it raises, or None
        self.weight_bytes = 0          # the figures the engine's stats read
        self.kv_bytes_per_token = 0

    def execute(self, step: StepInput) -> StepOutput:
        self.steps.append(step)
        if self.fail_if is not None:
            for rid in step.request_ids:
                exc = self.fail_if(rid)
                if exc is not None:
                    raise exc
        out = StepOutput()
        offset = 0
        for i, rid in enumerate(step.request_ids):
            n = step.num_new_tokens[i]
            task = step.pooling.get(rid)
            if task is not None:   # an embedding: [positions pooled, sum of their tokens]
                chunk = step.token_ids[offset:offset + n]
                if step.start_positions[i] == 0:
                    self.pool_sums[rid] = 0
                self.pool_sums[rid] = self.pool_sums.get(rid, 0) + sum(chunk)
                if task.finishes:
                    out.pooled[rid] = [float(step.start_positions[i] + n),
                                       float(self.pool_sums.pop(rid))]
            offset += n
            need = -(-(step.start_positions[i] + n) // self.block_size)
            if len(step.block_tables[i]) < need:
                raise AssertionError(f"block table too short for {rid}")
            if step.num_samples[i]:
                samp = step.sampling[i]
                total = sum(samp.prompt_token_ids) + sum(samp.output_token_ids)
                out.request_ids.append(rid)
                # speculative drafts (the last num_samples - 1 new tokens): greedy
                # verification, accepted while they equal what would be emitted
                end = sum(step.num_new_tokens[:i + 1])
                drafts = step.token_ids[end - step.num_samples[i] + 1:end]
                tokens = []
                for d in drafts:
                    t = self.next_token(total)
                    if t != d:
                        break
                    tokens.append(d)
                    total += d
                tokens.append(self.next_token(total))
                out.token_ids.append(tokens)
        return out

    def next_token(self, total: int) -> int:
        return 10 + total % (self.vocab - 10)

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
