"""The first start on a machine: compile the step graphs in a child process while the
engine already serves, eagerly.

Compiling the default model's decode graphs takes a minute or more on 2 cores. With
``compile_in_background`` (``llmserve serve``'s default) the engine loads the graphs that
are saved (graph_store.py) and, if any is missing, starts one child process that builds
the same runner (the same config and checkpoint, a small KV pool: the pool's size is a
dynamic dimension of the graphs), compiles every graph and saves it, at the lowest CPU
priority. Until it exits, decode and verify steps run eagerly and prefill chunks without
the compiled many-row functions: eager and compiled steps give a row the same logits (the
compiled graphs round like eager code, compile.py), so a sequence that spans the switch
gets the tokens it would have got either way. Between two steps after the child exits,
the runner loads the graphs (a second or two, once) and runs compiled from then on. No
request ever waits on a compile; a child that fails leaves the engine eager, with a
warning.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import threading
import time
from typing import TYPE_CHECKING, Optional

import torch

from llmserve.config import EngineConfig

if TYPE_CHECKING:
    from llmserve.model.executor.executor import RunnerArgs
    from llmserve.model.executor.runner import ModelRunner

logger = logging.getLogger(__name__)

#: KV blocks of the child's pool: the graphs index the pool through a dynamic dimension,
#: so a small pool compiles the same graphs as the engine's
CHILD_KV_BLOCKS = 64


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
        else:
            logger.warning("the background compile %s; steps keep running eagerly",
                           f"exited with code {code}" if code else "left graphs unsaved")

    def stop(self) -> None:
        if self.proc.is_alive():
            self.proc.terminate()
        self.proc.join(timeout=10)


def _exit_with_parent(parent_pid: int) -> None:
    """End this process when the engine's process is gone (a killed server leaves no
    orphan compiling for a minute)."""
    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(0)
            time.sleep(1.0)

    threading.Thread(target=watch, name="llmserve-compile-watch", daemon=True).start()


def _compile_entry(config: EngineConfig, args: "RunnerArgs",
                   parent_pid: int) -> None:  # pragma: no cover - runs in the child
    _exit_with_parent(parent_pid)
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


def start_if_missing(runner: "ModelRunner", args: "RunnerArgs") -> Optional[BackgroundCompile]:
    """Load the saved graphs into ``runner``; if one is missing, the child that makes them
    (None when every graph is ready)."""
    if runner.warmup(load_only=True):
        return None
    runner.pending_graphs = BackgroundCompile(runner.config, args)
    return runner.pending_graphs
