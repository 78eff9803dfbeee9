"""Starting the tensor-parallel ranks and the worker loop.

On one host rank 0 (the engine) spawns ranks 1..N-1 with ``torch.multiprocessing``
(``spawn``: a fresh interpreter, never a fork of a threaded server); each worker builds the
same :class:`~llmserve.model.executor.runner.ModelRunner` for its rank (with its
:class:`~llmserve.model.distributed.sharding.GroupSharding`) and then loops: receive the
step rank 0 broadcasts, run the forward pass (its collectives pair with rank 0's), repeat,
until the stop message. Under ``torchrun`` every rank is started by torchrun: rank 0 runs
the server as usual, the others call :func:`run_worker_from_env` (``llmserve serve``
does this when ``RANK`` > 0).

Workers never see HTTP, the scheduler or sampling: the broadcast ``StepInput`` carries no
``SequenceSampling`` (prompt and output ids stay on rank 0).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import socket
from typing import TYPE_CHECKING

import torch

from llmserve.config import EngineConfig
from llmserve.model.distributed.group import TensorParallelGroup
from llmserve.model.executor.capture import LogitsCapture
from llmserve.model.platform import exit_with_parent

if TYPE_CHECKING:
    from llmserve.engine.step_types import StepInput
    from llmserve.model.executor.executor import RunnerArgs
    from llmserve.model.loading.loader import CheckpointSource

logger = logging.getLogger(__name__)


def rank_device(config: EngineConfig, local_rank: int) -> torch.device:
    """This rank's device: ``cuda:<local rank>`` when serving on CUDA, else the CPU."""
    from llmserve.model.platform import resolve_device

    device = resolve_device(config.model.device)
    if device.type == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return device


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_entry(rank: int, world_size: int, config: EngineConfig, runner_args: RunnerArgs,
                  parent_pid: int) -> None:  # pragma: no cover - runs in spawned processes
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s %(levelname)s tp{rank} %(name)s: %(message)s")
    exit_with_parent(parent_pid)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    run_worker(rank, world_size, rank, config, runner_args)


def run_worker(rank: int, world_size: int, local_rank: int, config: EngineConfig,
               runner_args: RunnerArgs) -> None:
    """Join the group as ``rank``, build this rank's runner and serve steps until stopped."""
    from llmserve.model.distributed.sharding import GroupSharding
    from llmserve.model.executor.runner import ModelRunner
    from llmserve.model.loading.loader import open_checkpoint

    group = TensorParallelGroup(rank, world_size, rank_device(config, local_rank))
    source = open_checkpoint(runner_args.model_path)
    runner = ModelRunner(config, source, runner_args.max_model_len, runner_args.eos_token_ids,
                         sample_vocab_size=runner_args.sample_vocab_size,
                         sharding=GroupSharding(group))
    logger.info("tensor-parallel rank %d/%d ready", rank, world_size)
    try:
        while True:
            message = group.broadcast_control(None)
            if message is None:
                break
            runner.capture = message.capture
            step = message.step
            try:
                runner.execute(step)
            except (ValueError, OverflowError) as exc:
                # the step's own input: rank 0 fails on it at the same point and reports it
                logger.debug("step refused on rank %d: %r", rank, exc)
    except Exception as exc:  # noqa: BLE001 - anything else breaks the group: leave it, so
        # rank 0 sees this rank die (its pending collective fails) instead of waiting
        logger.exception("rank %d failed and leaves the group: %r", rank, exc)
        raise SystemExit(1) from exc
    finally:
        group.shutdown()


def run_worker_from_env(config: EngineConfig) -> None:
    """A non-zero rank started by ``torchrun`` (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``):
    serve rank 0's steps until it stops. Workers never sample, so only the context length
    (rotary table, block-table width) is derived here, as ``LLMEngine`` does."""
    from llmserve.default_model import resolve_model_path
    from llmserve.model.executor.executor import RunnerArgs
    from llmserve.model.loading.loader import open_checkpoint

    path = resolve_model_path(config.model.path)
    runner_args = RunnerArgs(model_path=path, max_model_len=config.model.max_model_len
                             or open_checkpoint(path).config.max_position_embeddings)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != config.parallel.tensor_parallel_size:
        raise ValueError(f"WORLD_SIZE {world} differs from --tensor-parallel-size "
                         f"{config.parallel.tensor_parallel_size}")
    run_worker(rank, world, int(os.environ.get("LOCAL_RANK", rank)), config, runner_args)


def start_rank_zero(config: EngineConfig, runner_args: RunnerArgs) -> TensorParallelGroup:
    """Rank 0: join the group, spawning ranks 1..N-1 unless torchrun started them."""
    world = config.parallel.tensor_parallel_size
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:   # torchrun (or another launcher)
        if int(os.environ["RANK"]) != 0:
            raise ValueError("only rank 0 runs the engine; other ranks call run_worker_from_env")
        local = int(os.environ.get("LOCAL_RANK", 0))
        return TensorParallelGroup(0, world, rank_device(config, local))
    import torch.multiprocessing as mp

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(_free_port())
    worker_config = config.replace(
        num_threads=config.model.num_threads or max(1, (os.cpu_count() or 1) // world))
    ctx = mp.get_context("spawn")
    procs = []
    for rank in range(1, world):
        proc = ctx.Process(target=_worker_entry, name=f"llmserve-tp{rank}", daemon=True,
                           args=(rank, world, worker_config, runner_args, os.getpid()))
        proc.start()
        procs.append(proc)
    try:
        group = TensorParallelGroup(0, world, rank_device(config, 0))
    except BaseException:
        for proc in procs:
            proc.kill()
            proc.join(5)
        raise
    group.watch_workers(procs)
    return group


@dataclasses.dataclass(frozen=True)
class StepMessage:
    """What rank 0 broadcasts each step: the step without its sampling state, and whether
    the logits it hands back (``ALL`` computes every row's: the vocab-parallel head is a
    collective, so all ranks compute the same rows)."""

    step: StepInput
    capture: LogitsCapture = LogitsCapture.NONE


def strip_sampling(step: StepInput) -> StepInput:
    """The step as workers need it: no per-sequence sampling state (it can be large)."""
    return dataclasses.replace(step, sampling=[None] * len(step.sampling))


def broadcast_step(group: TensorParallelGroup, step: StepInput, capture: LogitsCapture) -> None:
    """Rank 0: send this step to the workers."""
    group.broadcast_control(StepMessage(strip_sampling(step), capture))


def check_tensor_parallel(config: EngineConfig, source: CheckpointSource) -> None:
    """Refuse, before any process is spawned, a model that cannot be split: a family
    without a plan (mixture-of-experts) or shapes/formats the ranks cannot share; then
    give each rank's interpreter its share of the CPU threads."""
    from llmserve.model.distributed.layers import check_shardable
    from llmserve.model.platform import resolve_device, resolve_dtype
    from llmserve.model.quant import select_linear_method

    device = resolve_device(config.model.device)
    method = select_linear_method(config.model.quantization, config.model.quantization_group_size,
                                  source.config, resolve_dtype(config.model.dtype, device), device,
                                  config.model.int4_activations)
    check_shardable(source.config, config.parallel.tensor_parallel_size, method)
    if not config.model.num_threads and device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // config.parallel.tensor_parallel_size))
