"""AsyncLLM: the engine loop on a background thread, streamed to asyncio callers.

    caller (event loop)                     engine thread
    ------------------                      -------------
    generate(): tokenize + validate  --->   commands queue: add / abort
                 await deltas         <---  step(): deltas -> loop.call_soon_threadsafe
    aclose()/cancel -> abort         --->   abort runs before the next step (KV freed)
    await abort(id)                  <---   the aborted request's final output (KV is free)

Torch ops release the GIL, so the event loop keeps serving while a step runs.

One thread runs every torch op of the engine: :meth:`AsyncLLM.from_config` builds the
engine (weights, compile, warmup) on the engine thread itself. libgomp keeps an OpenMP
worker pool per thread that has run a parallel region; once two threads own pools, more
threads are managed than there are cores and every worker is throttled from spinning to
sleeping between regions, which made each decode step much slower when the engine was
built on the main thread and stepped on this one (docs/BENCHMARKS.md, "One thread owns the OpenMP pools").
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Optional, Sequence, Union

from llmserve.config import EngineConfig
from llmserve.engine.request import Request
from llmserve.llm_engine import LLMEngine, PromptType, UserRequest
from llmserve.pooling_params import PoolingParams
from llmserve.protocol import EngineStats, RequestOutput
from llmserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


# ---- what the event loops send the engine thread (one queue, handled between steps) ------
@dataclass(frozen=True)
class AddRequest:
    """Admit a prepared request (the caller's and its ``n`` children)."""

    user: UserRequest
    children: list[Request]


@dataclass(frozen=True)
class AbortRequest:
    """Abort a request by its engine id; ``confirm`` (if any) gets its final output."""

    request_id: str
    confirm: "Optional[asyncio.Future]" = None


@dataclass(frozen=True)
class CallOnEngine:
    """Run ``fn(engine, *args)`` between steps; ``done`` gets the result or the error."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    done: "asyncio.Future"


@dataclass(frozen=True)
class Wake:
    """Nothing to do: wakes the engine thread (at shutdown)."""


EngineCommand = Union[AddRequest, AbortRequest, CallOnEngine, Wake]

class EngineDeadError(RuntimeError):
    """The engine loop crashed; no request can complete."""


class _Stream:
    __slots__ = ("loop", "queue", "request_id")

    def __init__(self, loop: asyncio.AbstractEventLoop, request_id: str) -> None:
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.request_id = request_id  # the caller's id; the engine sees a unique internal one

    def put(self, item: object) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


def _put_all(items: list[tuple[asyncio.Queue, object]]) -> None:
    """On the event loop: hand each stream its delta of one step, in engine order."""
    for q, item in items:
        q.put_nowait(item)


class AsyncLLM:
    """Async front of an LLMEngine running on its own thread."""

    def __init__(self, engine: Optional[LLMEngine] = None, *,
                 engine_factory: Optional[Callable[[], LLMEngine]] = None) -> None:
        """Serve ``engine``, or the engine ``engine_factory`` builds on the engine thread
        (so that thread is the only one running torch ops; see the module docstring).
        With a factory this waits until the engine is built and re-raises its error."""
        if (engine is None) == (engine_factory is None):
            raise ValueError("pass an engine or an engine_factory, not both or neither")
        self._commands: "queue.SimpleQueue[EngineCommand]" = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}      # internal engine id -> stream
        self._internal: dict[str, str] = {}          # caller's id -> internal engine id
        self._aborting: dict[str, asyncio.Future] = {}  # caller's id -> abort confirmation
        self._counter = itertools.count()
        self._closed = False
        self._last_audit = 0.0
        self.ledger_errors = 0     # failed idle KV-ledger audits (should stay 0)
        self._dead: Optional[BaseException] = None
        self._stop = threading.Event()
        self._built = threading.Event()
        self._build_error: Optional[BaseException] = None
        if engine is not None:
            self._adopt(engine)
        self._thread = threading.Thread(target=self._run, args=(engine_factory,),
                                        name="llmserve-engine", daemon=True)
        self._thread.start()
        if engine is None:
            self._built.wait()
            if self._build_error is not None:
                self._thread.join()
                raise self._build_error

    def _adopt(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_name = engine.model_name
        self.fingerprint = engine.system_fingerprint
        self.max_model_len = engine.max_model_len
        self.block_size = engine.config.cache.block_size
        self._stats = engine.get_stats()

    def _run(self, factory: Optional[Callable[[], LLMEngine]]) -> None:
        """The engine thread: build the engine (with a factory), then loop."""
        if factory is not None:
            try:
                self._adopt(factory())
            except BaseException as exc:  # noqa: BLE001 - handed to the constructor
                self._build_error = exc
                self._closed = True
                return
            finally:
                self._built.set()
        self._loop()

    @classmethod
    def from_config(cls, config: EngineConfig, **engine_kwargs: Any) -> "AsyncLLM":
        """Build the engine for ``config`` on the engine thread and start serving it
        (``engine_kwargs`` go to :class:`LLMEngine`, e.g. ``kv_events``)."""
        return cls(engine_factory=lambda: LLMEngine(config, **engine_kwargs))

    # ---- client side ----------------------------------------------------------------------
    def is_ready(self) -> bool:
        return (self._dead is None and self._thread.is_alive()
                and self.engine.executor.healthy)  # e.g. a TP worker died

    def get_stats(self) -> EngineStats:
        return self._stats

    def kernel_plan(self) -> dict[str, Any]:
        """Which kernel runs each operation, decided at start-up (KernelPlanReport); empty
        while the engine is still being built."""
        engine = getattr(self, "engine", None)
        return {} if engine is None else engine.runner.kernel_plan

    async def generate(
        self, prompt: PromptType, params: SamplingParams, request_id: str, *,
        priority: "int | str | None" = None, cache_salt: Optional[str] = None,
        deadline: Optional[float] = None, queue_deadline: Optional[float] = None,
        prediction: Optional[str] = None, lora: Optional[str] = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream RequestOutput deltas; closing or cancelling the iterator aborts the request.
        ``prediction``: the expected output text (Predicted Outputs); ``lora``: a loaded
        LoRA adapter's name."""
        self._check_alive()
        spec = getattr(params, "structured_output", None)
        if spec is not None:  # compile on the grammar thread: the engine thread never waits
            params = self.engine.grammars.bind(
                params, await self.engine.grammars.compile_async(spec))
        if request_id in self._internal:
            raise ValueError(f"request id {request_id!r} is already running")
        # A unique engine id per call: a retry that reuses the caller's id can never
        # receive the deltas of the earlier request that is still being aborted.
        internal = f"{request_id}@{next(self._counter)}"
        user, children = self.engine.make_requests(
            internal, prompt, params, priority=priority, cache_salt=cache_salt,
            deadline=deadline, queue_deadline=queue_deadline, prediction=prediction, lora=lora)
        async with contextlib.aclosing(self._stream(request_id, user, children)) as outs:
            async for out in outs:   # closing this iterator closes (aborts) that one
                yield out

    @property
    def embedding_size(self) -> int:
        """Length of an embedding before ``dimensions`` cuts it (the hidden size)."""
        return self.engine.embedding_size

    @property
    def pooling(self) -> str:
        """The engine's default pooling method (``--pooling``)."""
        return self.engine.config.model.pooling

    async def embed(
        self, prompt: PromptType, pooling: Optional[PoolingParams], request_id: str, *,
        priority: "int | str | None" = None, cache_salt: Optional[str] = None,
        deadline: Optional[float] = None, queue_deadline: Optional[float] = None,
    ) -> AsyncIterator[RequestOutput]:
        """Run one embedding request (prefill only, batched with generation in the same
        steps); yields its one final output, whose ``embedding`` is the vector (None
        when it ended otherwise, e.g. ``timeout``). Closing the iterator aborts it."""
        self._check_alive()
        if request_id in self._internal:
            raise ValueError(f"request id {request_id!r} is already running")
        internal = f"{request_id}@{next(self._counter)}"
        user, children = self.engine.make_embedding_request(
            internal, prompt, pooling, priority=priority, cache_salt=cache_salt,
            deadline=deadline, queue_deadline=queue_deadline)
        async with contextlib.aclosing(self._stream(request_id, user, children)) as outs:
            async for out in outs:   # closing this iterator closes (aborts) that one
                yield out

    async def _stream(self, request_id: str, user: UserRequest, children: list[Request]
                      ) -> AsyncIterator[RequestOutput]:
        """Admit a prepared request and stream its outputs under the caller's id."""
        internal = user.request_id
        stream = _Stream(asyncio.get_running_loop(), request_id)
        self._streams[internal] = stream
        self._internal[request_id] = internal
        self._commands.put(AddRequest(user, children))
        self._check_alive()  # the loop may have died while we registered
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True  # nothing left in the engine to abort
                    raise item
                if item.error is not None:  # the model step failed on this request alone
                    finished = item.finished  # otherwise its other completions are aborted
                    raise item.error
                item.request_id = request_id
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self._post_abort(request_id, internal)
            self._streams.pop(internal, None)
            if self._internal.get(request_id) == internal:
                del self._internal[request_id]

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"engine loop died: {self._dead!r}")
        if self._closed:
            raise EngineDeadError("the engine is shut down")
        if not self.engine.executor.healthy:
            raise EngineDeadError("a tensor-parallel worker died; the engine cannot run steps")

    async def abort(self, request_id: str) -> Optional[RequestOutput]:
        """Abort a running request by the caller's id and wait until the engine thread has
        done it: returns the request's final output (its KV blocks are free by then; its
        ``metrics.first_scheduled_time`` says whether it was ever scheduled), or None for
        an unknown or already finished id. Also waits for an abort that closing the
        request's stream already sent."""
        internal = self._internal.get(request_id)
        confirm = self._post_abort(request_id, internal) if internal is not None \
            else self._aborting.get(request_id)
        if confirm is None:
            return None
        return await asyncio.shield(confirm)

    def _post_abort(self, request_id: str, internal: str) -> "Optional[asyncio.Future]":
        """Send an abort to the engine thread; the future resolves to its final output."""
        confirm = self._aborting.get(request_id)
        if confirm is None or confirm.done():
            try:
                confirm = asyncio.get_running_loop().create_future()
            except RuntimeError:  # no event loop (a stream finalized late): just abort
                self._commands.put(AbortRequest(internal))
                return None
            self._aborting[request_id] = confirm
            confirm.add_done_callback(lambda f: self._aborting.pop(request_id, None)
                                      if self._aborting.get(request_id) is f else None)
            self._commands.put(AbortRequest(internal, confirm))
            if self._closed:  # no engine thread left to answer
                confirm.set_result(None)
        return confirm

    # ---- cache operations (run on the engine thread, between steps) ----------------------
    async def call_on_engine(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(engine, *args)`` on the engine thread between steps; its result (or
        exception) comes back here."""
        self._check_alive()
        done = asyncio.get_running_loop().create_future()
        self._commands.put(CallOnEngine(fn, args, done))
        if self._closed and not done.done():
            done.set_exception(EngineDeadError("the engine is shut down"))
        return await done

    async def pin_prefix(self, pin_id: str, token_ids: Sequence[int], cache_salt: Optional[str],
                         max_blocks: Optional[int] = None) -> int:
        """Pin the cached blocks of a prefilled prefix (LLMEngine.pin_prefix)."""
        return await self.call_on_engine(LLMEngine.pin_prefix, pin_id, list(token_ids),
                                         cache_salt, max_blocks)

    async def unpin_prefix(self, pin_id: str) -> int:
        """Release a pin (LLMEngine.unpin_prefix)."""
        return await self.call_on_engine(LLMEngine.unpin_prefix, pin_id)

    async def flush_prefix_cache(self, namespace: Optional[str] = None, *,
                                 with_children: bool = False) -> int:
        """Forget cached prefixes, all or one namespace's (LLMEngine.reset_prefix_cache)."""
        return await self.call_on_engine(
            lambda engine: engine.reset_prefix_cache(namespace, with_children=with_children))

    async def cache_stats(self) -> dict:
        """The prefix cache's blocks, pins and hit counters (LLMEngine.cache_stats)."""
        return await self.call_on_engine(LLMEngine.cache_stats)

    def lora_adapters(self) -> list[dict]:
        """The loaded LoRA adapters (EngineLoras.describe of each)."""
        return [self.engine.loras.describe(r) for r in self.engine.loras.list()]

    async def load_lora_adapter(self, name: str, path: str) -> dict:
        """Register a LoRA adapter (EngineLoras.add); returns its description."""
        return await self.call_on_engine(
            lambda engine: engine.loras.describe(engine.loras.add(name, path)))

    async def unload_lora_adapter(self, name: str) -> None:
        """Unregister a LoRA adapter (EngineLoras.remove: LoraInUse while in use)."""
        await self.call_on_engine(lambda engine: engine.loras.remove(name))

    async def set_cache_audit_rate(self, rate: float) -> None:
        """Share of prefix hits written to the ``llmserve.cache_audit`` log."""
        await self.call_on_engine(LLMEngine.set_cache_audit_rate, rate)

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the engine thread; every open stream ends with EngineDeadError."""
        self._closed = True
        self._stop.set()
        self._commands.put(Wake())
        self._thread.join(timeout)
        self.engine.grammars.shutdown()
        self.engine.executor.shutdown()   # tensor-parallel workers: stop and reap them

    # ---- engine thread --------------------------------------------------------------------
    def _handle(self, cmd: EngineCommand) -> None:
        match cmd:
            case AddRequest(user, children):
                try:
                    self.engine.add_prepared(user, children)
                except Exception as exc:  # e.g. a duplicate id: report to that caller only
                    stream = self._streams.get(user.request_id)
                    if stream is not None:
                        stream.put(exc)
            case AbortRequest(request_id, confirm):
                out = self.engine.abort_request(request_id)
                if out is not None:
                    self._deliver_step([out])
                if confirm is not None:  # the caller waits for the confirmation
                    self._resolve(confirm, out)
            case CallOnEngine(fn, args, done):
                try:
                    self._resolve(done, fn(self.engine, *args))
                except Exception as exc:  # noqa: BLE001 - the caller gets the error
                    self._resolve(done, exc, failed=True)
            case Wake():
                pass

    @staticmethod
    def _resolve(future: "asyncio.Future", value: object, failed: bool = False) -> None:
        """Resolve an event-loop future from the engine thread (if still pending);
        ``failed``: ``value`` is an exception to raise there."""
        def settle() -> None:
            if not future.done():
                if failed:
                    future.set_exception(value)  # type: ignore[arg-type]
                else:
                    future.set_result(value)
        try:
            future.get_loop().call_soon_threadsafe(settle)
        except RuntimeError:  # the event loop is closed
            pass

    def _deliver_step(self, outs: list[RequestOutput]) -> None:
        """One step's deltas with one wake-up per event loop, not one per stream: every
        ``call_soon_threadsafe`` writes to the loop's self-pipe and takes the GIL from
        the loop thread (at 24 streams that showed in the engine thread's profile:
        docs/BENCHMARKS.md)."""
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                batches.setdefault(stream.loop, []).append((stream.queue, out))
        for loop, items in batches.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _loop(self) -> None:
        engine = self.engine
        idle = False
        try:
            while not self._stop.is_set():
                wait = not engine.has_unfinished_requests() or idle
                try:
                    cmd = (self._commands.get(timeout=0.5 if not idle else 0.01) if wait
                           else self._commands.get_nowait())
                    self._handle(cmd)
                    while True:
                        self._handle(self._commands.get_nowait())
                except queue.Empty:
                    pass
                idle = False
                if not engine.has_unfinished_requests():
                    self._audit_when_idle()
                    try:
                        engine.on_idle()
                    except Exception:  # noqa: BLE001 - e.g. saved graphs that fail to load
                        logger.exception("idle work failed; serving on")
                if engine.has_unfinished_requests():
                    try:
                        # a runner failure fails only its culprits (EngineCore isolates
                        # them: their outputs carry a RequestFailedError for their caller)
                        outs = engine.step()
                    except Exception as exc:  # noqa: BLE001 - a bug outside the runner
                        logger.exception("engine step failed outside the model runner; "
                                         "aborting in-flight requests")
                        self._fail_all(exc)
                        outs = []
                    self._deliver_step(outs)
                    idle = not outs and not engine.scheduler.running
                self._stats = engine.get_stats()
        except BaseException as exc:  # noqa: BLE001 - report the crash to every caller
            logger.exception("engine loop crashed")
            self._dead = exc
        finally:
            self._closed = True
            err = EngineDeadError(f"engine loop stopped: {self._dead!r}" if self._dead
                                  else "the engine is shut down")
            for stream in list(self._streams.values()):
                stream.put(err)
            for confirm in list(self._aborting.values()):  # nobody left to abort anything
                self._resolve(confirm, None)
            while True:  # cache operations still queued: nobody will run them
                try:
                    cmd = self._commands.get_nowait()
                except queue.Empty:
                    break
                if isinstance(cmd, CallOnEngine):
                    self._resolve(cmd.done, err, failed=True)

    def _audit_when_idle(self, every_s: float = 30.0) -> None:
        """While idle, check the KV ledger now and then: every block free, none lost."""
        now = time.monotonic()
        if now - self._last_audit < every_s:
            return
        self._last_audit = now
        try:
            self.engine.check_invariants()
        except Exception:  # noqa: BLE001 - report, keep serving
            logger.exception("KV ledger check failed while idle")
            self.ledger_errors += 1

    def _fail_all(self, exc: Exception) -> None:
        """After a failed step: end every request in the engine and tell its caller."""
        err = RuntimeError(f"engine step failed: {exc!r}")
        for internal in list(self._streams):
            self.engine.abort_request(internal)
            stream = self._streams.get(internal)
            if stream is not None:
                stream.put(err)


