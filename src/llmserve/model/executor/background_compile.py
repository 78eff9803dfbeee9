"""The first start on a machine: compile the step graphs in a child process while the
engine already serves, eagerly.

Compiling the default model's decode graphs takes a minute or more on 2 cores. With
``compile_in_background`` (``llmserve serve``'s default) the engine loads the graphs that
are saved (graph_store.py) and, if any is missing, starts one child process that builds
the same runner (the same config and checkpoint, a small KV pool: the pool's size is a
dynamic dimension of the graphs), compiles every graph and saves it, at the lowest CPU
priority. Until it exits, decode and verify steps run eagerly, and prefill chunks without
the many-row functions that were not saved yet: eager and compiled steps give a row the
same logits (the
compiled graphs round like eager code, compile.py), so a sequence that spans the switch
gets the tokens it would have got either way. Between two steps after the child exits,
the runner loads the graphs (a second or two, once) and runs compiled from then on. No
request ever waits on a compile; a child that fails leaves the engine eager, with a
warning. Where a child cannot help (graphs that cannot be saved, a GPU, too little memory
for its copy of the weights) the engine compiles before it is ready, as with
``--startup-compile wait``.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import time
from typing import TYPE_CHECKING, Optional

import torch

from llmserve.config import EngineConfig
from llmserve.model.platform import exit_with_parent

if TYPE_CHECKING:
    from llmserve.model.executor.executor import RunnerArgs
    from llmserve.model.executor.runner import ModelRunner

logger = logging.getLogger(__name__)

#: KV blocks of the child's pool: the graphs index the pool through a dynamic dimension,
#: so a small pool compiles the same graphs as the engine's
CHILD_KV_BLOCKS = 64
#: The child's exit code when it compiled every graph but could not save one
UNSAVED_EXIT = 3
#: Free memory the child needs, in multiples of the model's resident weights (it loads a
#: copy of them)
CHILD_MEMORY_FACTOR = 1.5


class BackgroundCompile:
    """One child process compiling and saving the step graphs of ``config``."""

    def __init__(self, config: EngineConfig, args: "RunnerArgs") -> None:
        ctx = mp.get_context("spawn")   # a fresh interpreter, never a fork of a server
        self.started = time.time()
        # this process's thread count, whatever set it: a guard of every graph and part
        # of its file's name
        config = config.replace(num_threads=torch.get_num_threads())
        self.proc = ctx.Process(target=_compile_entry, name="llmserve-compile", daemon=True,
                                args=(config, args, os.getpid()))
        self.proc.start()
        logger.info("compiling the step graphs in a child process (pid %s; about a minute "
                    "on 2 cores, once per machine and model); steps run eagerly until then",
                    self.proc.pid)

    def poll(self, runner: "ModelRunner") -> None:
        """Between steps: once the child has exited, load its graphs into ``runner`` (or
        warn and stay eager) and detach from it."""
        if self.proc.is_alive():
            return
        runner.pending_graphs = None
        code = self.proc.exitcode
        if code == 0 and runner.warmup(load_only=True):
            logger.info("compiled step graphs loaded %.0fs after start-up; steps run "
                        "compiled from now on", time.time() - self.started)
        elif code == UNSAVED_EXIT:
            logger.warning("the background compile could not save every graph (its log says "
                           "which); steps keep running eagerly: --startup-compile wait "
                           "compiles them in the server's process")
        else:
            logger.warning("the background compile %s; steps keep running eagerly",
                           f"exited with code {code}" if code else "left graphs unsaved")

    def stop(self) -> None:
        """End the child (the engine shuts down before it finished)."""
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=5)


def _compile_entry(config: EngineConfig, args: "RunnerArgs",
                   parent_pid: int) -> None:  # pragma: no cover - runs in the child
    exit_with_parent(parent_pid, code=0)
    try:
        os.nice(19)
    except OSError:
        pass
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s "
                        "(background compile): %(message)s")
    from llmserve.model.executor.runner import ModelRunner
    from llmserve.model.loading.loader import open_checkpoint

    child = config.replace(num_kv_blocks=CHILD_KV_BLOCKS, compile_in_background=False)
    runner = ModelRunner(child, open_checkpoint(args.model_path), args.max_model_len,
                         args.eos_token_ids, sample_vocab_size=args.sample_vocab_size)
    runner.warmup()
    if not runner.warmup(load_only=True):   # a graph the AOT compiler would not save
        raise SystemExit(UNSAVED_EXIT)


def start_if_missing(runner: "ModelRunner", args: "RunnerArgs") -> Optional[BackgroundCompile]:
    """Load the saved graphs into ``runner``; if one is missing, the child that makes them
    (None when every graph is ready). Where a child cannot help, the runner compiles now,
    as ``--startup-compile wait`` does: graphs that cannot be saved (LoRA slots,
    ``LLMSERVE_SAVED_GRAPHS=0``), a device other than the CPU, too little free memory for
    a second copy of the weights, or a child that cannot be started."""
    reason = _why_not_background(runner)
    if reason:
        logger.info("compiling before serving: %s", reason)
        runner.warmup()
        return None
    if runner.warmup(load_only=True):
        return None
    try:
        runner.pending_graphs = BackgroundCompile(runner.config, args)
    except Exception as exc:  # noqa: BLE001 - no child process here: compile in process
        logger.warning("no background compile (%s: %s); compiling before serving",
                       type(exc).__name__, exc)
        runner.warmup()
        return None
    return runner.pending_graphs


def _why_not_background(runner: "ModelRunner") -> str:
    """Why a background compile cannot make this runner's graphs ('' if it can)."""
    from llmserve.model.executor.inductor_setup import saving_enabled
    from llmserve.model.platform import available_memory_bytes

    steps = [s for s in (runner.compiled, runner.compiled_verify) if s is not None]
    if not steps:
        return "nothing is compiled"
    if not saving_enabled() or any(not s.saves_graphs for s in steps):
        return "these graphs cannot be saved"
    if runner.device.type != "cpu":
        return f"a background compile runs on the CPU only, not {runner.device.type}"
    need = CHILD_MEMORY_FACTOR * runner.weight_bytes
    if available_memory_bytes(runner.device) < need:
        return f"less than {need / 2**30:.1f} GiB free for a compiling copy of the model"
    return ""
