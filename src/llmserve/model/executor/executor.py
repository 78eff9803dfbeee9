"""Executors: the process topology above a rank-agnostic :class:`ModelRunner`.

The engine core calls ``execute(StepInput) -> StepOutput`` and ``release(request_id)``
(its ``Runner`` protocol) on an executor, never on a runner directly:

* :class:`LocalExecutor` -- one process, one device: the runner itself.
* :class:`TensorParallelExecutor` -- rank 0 of a tensor-parallel group. It checks the
  family's plan and the shapes *before* any worker process is spawned, starts ranks
  1..N-1 (or joins those ``torchrun`` started), builds rank 0's runner with this rank's
  sharding, and broadcasts each step to the workers before running it.

The runner only ever sees a :class:`~llmserve.model.executor.sharding.RankSharding` (or
None): it knows how to cut its own model, not that other processes exist.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Protocol

from llmserve.config import EngineConfig
from llmserve.engine.step_types import StepInput, StepOutput
from llmserve.model.executor.background_compile import start_if_missing
from llmserve.model.executor.kv_prefault import KVPrefaulter, start_kv_prefault
from llmserve.model.executor.runner import ModelRunner
from llmserve.model.loading.loader import CheckpointSource

if TYPE_CHECKING:
    from llmserve.model.distributed.group import TensorParallelGroup

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunnerArgs:
    """What every rank needs to build its runner, besides the engine config (sent to the
    spawned workers, so plain picklable values only)."""

    model_path: str
    max_model_len: int
    eos_token_ids: frozenset[int] = frozenset()
    sample_vocab_size: Optional[int] = None


class Executor(Protocol):
    """What the engine holds: the step entry points plus rank 0's runner (for its
    attributes: KV pool size, dtypes, quantization, logits adjuster)."""

    runner: ModelRunner

    @property
    def weight_bytes(self) -> int:
        """Resident weight bytes of this rank's runner."""
        ...

    @property
    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes one token takes on this rank."""
        ...

    def execute(self, step: StepInput) -> StepOutput:
        """Run one step on every rank; rank 0's output."""
        ...

    def release(self, request_id: str) -> None:
        """Forget a finished request's sampling state."""
        ...

    def warmup(self) -> None:
        """Compile what the request path would otherwise compile on first use."""
        ...

    def idle(self) -> None:
        """While no request runs: work that waits for no step (loading the graphs a
        background compile has finished)."""
        ...

    @property
    def healthy(self) -> bool:
        """False once a step can no longer run (a tensor-parallel worker died)."""
        ...

    def shutdown(self) -> None:
        """Stop and reap worker processes (no-op for one process)."""
        ...


class _RankZero:
    """What both executors delegate to rank 0's runner: its figures, per-request state and
    warm-up."""

    runner: ModelRunner

    @property
    def weight_bytes(self) -> int:
        return self.runner.weight_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return self.runner.kv_bytes_per_token

    def release(self, request_id: str) -> None:
        self.runner.release(request_id)

    def warmup(self) -> None:
        self.runner.warmup()

    def idle(self) -> None:
        self.runner.poll_background_compile()


class LocalExecutor(_RankZero):
    """One process, one device."""

    def __init__(self, runner: ModelRunner, args: Optional[RunnerArgs] = None) -> None:
        self.runner = runner
        self.args = args
        self.busy = False
        self.last_step_end = 0.0   # time.monotonic() when the last step ended
        #: commits the KV pool's next blocks while no step runs (kv_prefault.py)
        self.prefault: Optional[KVPrefaulter] = None

    def warmup(self) -> None:
        """Make the compiled graphs ready; with ``compile_in_background`` (and the runner's
        arguments to build a copy) only load those saved and leave the rest to a child
        process (background_compile.py). Then start committing the KV pool's next blocks
        in the background (kv_prefault.py)."""
        if self.args is not None and self.runner.config.model.compile_in_background:
            start_if_missing(self.runner, self.args)
        else:
            self.runner.warmup()
        if self.prefault is None:
            cfg = self.runner.config
            self.prefault = start_kv_prefault(
                self.runner.kv_caches, cfg.cache.block_size, self.runner.committed_blocks,
                self.runner.num_blocks, cfg.cache.kv_cache_prefault_tokens,
                cfg.scheduler.max_num_seqs, lambda: self.busy, lambda: self.last_step_end)

    def execute(self, step: StepInput) -> StepOutput:
        self.busy = True
        try:
            return self.runner.execute(step)
        finally:
            self.busy = False
            self.last_step_end = time.monotonic()

    @property
    def healthy(self) -> bool:
        return True

    def shutdown(self) -> None:
        """Stop a background compile and a background KV commit still running."""
        pending, self.runner.pending_graphs = self.runner.pending_graphs, None
        if pending is not None:
            pending.stop()
        if self.prefault is not None:
            self.prefault.stop()


class TensorParallelExecutor(_RankZero):
    """Rank 0 of ``config.parallel.tensor_parallel_size`` ranks (see the module docstring)."""

    def __init__(self, config: EngineConfig, source: CheckpointSource, args: RunnerArgs) -> None:
        from llmserve.model.distributed.workers import check_tensor_parallel, start_rank_zero

        check_tensor_parallel(config, source)   # refuse what cannot be split: nothing spawned yet
        self.group: TensorParallelGroup = start_rank_zero(config, args)
        try:
            from llmserve.model.distributed.sharding import GroupSharding

            self.runner = ModelRunner(config, source, args.max_model_len, args.eos_token_ids,
                                      sample_vocab_size=args.sample_vocab_size,
                                      sharding=GroupSharding(self.group))
        except BaseException:
            self.group.shutdown()
            raise

    def execute(self, step: StepInput) -> StepOutput:
        from llmserve.model.distributed.workers import broadcast_step

        if step.num_seqs:
            broadcast_step(self.group, step, self.runner.capture)
        return self.runner.execute(step)

    @property
    def healthy(self) -> bool:
        return self.group.healthy

    def shutdown(self) -> None:
        self.group.shutdown()


def build_executor(config: EngineConfig, source: CheckpointSource, args: RunnerArgs) -> Executor:
    """The executor ``config`` asks for: tensor-parallel ranks or one process."""
    if config.parallel.tensor_parallel_size > 1:
        return TensorParallelExecutor(config, source, args)
    return LocalExecutor(ModelRunner(config, source, args.max_model_len, args.eos_token_ids,
                                     sample_vocab_size=args.sample_vocab_size), args)
