"""One admitted generation request in flight: engine streams in, choices accumulated.

:class:`GenerationRun` starts one engine request per prompt, merges their output
increments, keeps per-choice state (text, token counts, logprobs, finish reason),
feeds the latency metrics, tells the gateway when the engine first scheduled it
(``on_started``), and -- exactly once, in :meth:`GenerationRun.finish` -- aborts
whatever is still running in the engine, releases the request ids and tells the
gateway how the request ended (``on_complete``, awaited).
"""
from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Optional

from llmserve.protocol import RequestFailedError, RequestOutput, TokenLogprob
from llmserve.sampling_params import SamplingParams
from llmserve.server.errors import OpenAIError, request_failed_to_openai, value_error_to_openai
from llmserve.server.gateway_hook import (CapturedResponse, RequestContext, RequestOutcome, Usage,
                                          notify_complete, notify_started)
from llmserve.server.metrics import RequestTimer, ServerMetrics

logger = logging.getLogger(__name__)

_END = object()


@functools.lru_cache(maxsize=None)
def supports_queue_deadline(engine_type: type) -> bool:
    """Whether ``engine_type.generate`` takes ``queue_deadline`` (it is optional)."""
    try:
        params = inspect.signature(engine_type.generate).parameters
    except (TypeError, ValueError, AttributeError):
        return False
    return "queue_deadline" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


@dataclass
class ChoiceState:
    """Everything received so far for one choice of the response."""

    index: int
    text_parts: list[str] = field(default_factory=list)
    text_len: int = 0
    num_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: Optional[str] = None
    stop_reason: Any = None

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


@dataclass
class ChoiceDelta:
    """What one engine increment added to one choice."""

    index: int
    text: str
    logprobs: Optional[list[TokenLogprob]]
    finish_reason: Optional[str]
    stop_reason: Any
    text_offset: int          # characters of this choice's text before this delta
    new_tokens: int


class GenerationRun:
    """The engine side of one HTTP generation request (one or more prompts, n choices each)."""

    def __init__(
        self,
        engine: Any,
        prompts: list[list[int]],
        params: SamplingParams,
        engine_ids: list[str],
        ctx: RequestContext,
        metrics: ServerMetrics,
        timer: RequestTimer,
        gateway: Any,
        release_ids: Callable[[list[str]], None],
        served_model: Optional[str] = None,
    ) -> None:
        self.engine = engine
        self.served_model = served_model
        self.prompts = prompts
        self.params = params
        self.engine_ids = engine_ids
        self.ctx = ctx
        self.metrics = metrics
        self.timer = timer
        self.gateway = gateway
        self._release_ids = release_ids
        self.n = params.n
        self.choices = [ChoiceState(i) for i in range(len(prompts) * self.n)]
        self.prompt_tokens = [len(p) for p in prompts]
        self.cached_tokens = [0] * len(prompts)
        self.unfinished = set(range(len(prompts)))
        self.started = False
        self._finished = False
        metrics.in_progress.inc()

    # -- engine side -------------------------------------------------------------------

    async def _open(self, prompt_idx: int) -> AsyncIterator[RequestOutput]:
        ctx = self.ctx
        kwargs: dict[str, Any] = {}
        if ctx.queue_deadline is not None and supports_queue_deadline(type(self.engine)):
            kwargs["queue_deadline"] = ctx.queue_deadline
        stream = self.engine.generate(
            self.prompts[prompt_idx], self.params, self.engine_ids[prompt_idx],
            priority=ctx.priority, cache_salt=ctx.cache_salt, deadline=ctx.deadline, **kwargs)
        if inspect.isawaitable(stream):  # an `async def` returning an iterator
            stream = await stream
        return stream

    async def _single(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        stream = await self._open(0)
        try:
            async for out in stream:
                yield 0, out
        finally:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()

    async def _merged(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int) -> None:
            stream = None
            try:
                stream = await self._open(i)
                async for out in stream:
                    queue.put_nowait((i, out, None))
                queue.put_nowait((i, None, _END))
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # noqa: BLE001 - forwarded to the consumer
                queue.put_nowait((i, None, exc))
            finally:
                aclose = getattr(stream, "aclose", None)
                if aclose is not None:
                    await aclose()

        tasks = [asyncio.ensure_future(pump(i)) for i in range(len(self.prompts))]
        try:
            remaining = len(tasks)
            while remaining:
                i, out, err = await queue.get()
                if err is _END:
                    remaining -= 1
                elif err is not None:
                    raise err
                else:
                    yield i, out
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def deltas(self) -> AsyncIterator[list[ChoiceDelta]]:
        """Yield, per engine increment, the changes to the response's choices.

        A ValueError from the engine (invalid request) becomes a 400 OpenAIError, a
        RequestFailedError (the model step failed on this request alone) a 400 or 500.
        """
        source = self._single() if len(self.prompts) == 1 else self._merged()
        try:
            async for prompt_idx, out in source:
                yield self._apply(prompt_idx, out, time.monotonic())
        except ValueError as exc:
            raise value_error_to_openai(exc) from None
        except RequestFailedError as exc:
            raise request_failed_to_openai(exc) from None
        finally:
            await source.aclose()
        if self.unfinished:
            # The engine ended a stream without a final output: it aborted the request.
            logger.warning("engine streams %s ended without finishing; treating as aborted",
                           [self.engine_ids[i] for i in sorted(self.unfinished)])
            changed = []
            for i in sorted(self.unfinished):
                for state in self.choices[i * self.n:(i + 1) * self.n]:
                    if state.finish_reason is None:
                        state.finish_reason = "abort"
                        self.timer.on_choice_finished(state.index, state.num_tokens, "abort")
                        changed.append(ChoiceDelta(state.index, "", None, "abort", None,
                                                   state.text_len, 0))
            self.unfinished.clear()
            if changed:
                yield changed

    def _note_started(self, out: RequestOutput) -> None:
        """Tell the gateway once that the engine has scheduled the request."""
        if self.started:
            return
        scheduled = out.metrics is not None and out.metrics.first_scheduled_time is not None
        if scheduled or any(c.num_tokens or c.token_ids for c in out.outputs):
            self.started = True
            notify_started(self.gateway, self.ctx)

    def _apply(self, prompt_idx: int, out: RequestOutput, now: float) -> list[ChoiceDelta]:
        self._note_started(out)
        changed = []
        for c in out.outputs:
            if not 0 <= c.index < self.n:
                logger.warning("engine returned choice index %s for n=%s", c.index, self.n)
                continue
            state = self.choices[prompt_idx * self.n + c.index]
            new_tokens = max(0, c.num_tokens - state.num_tokens) if c.num_tokens else len(c.token_ids)
            offset = state.text_len
            if c.text:
                state.text_parts.append(c.text)
                state.text_len += len(c.text)
            state.num_tokens = max(state.num_tokens + new_tokens, c.num_tokens)
            if c.logprobs:
                state.logprobs.extend(c.logprobs)
            self.timer.on_tokens(state.index, new_tokens, now)
            if c.finish_reason is not None and state.finish_reason is None:
                state.finish_reason = str(getattr(c.finish_reason, "value", c.finish_reason))
                state.stop_reason = c.stop_reason
                self.timer.on_choice_finished(state.index, state.num_tokens, state.finish_reason)
            changed.append(ChoiceDelta(state.index, c.text, c.logprobs,
                                       state.finish_reason if c.finish_reason else None,
                                       c.stop_reason, offset, new_tokens))
        if out.finished:
            self.unfinished.discard(prompt_idx)
            self.cached_tokens[prompt_idx] = out.num_cached_tokens or 0
            if out.prompt_token_ids:
                self.prompt_tokens[prompt_idx] = len(out.prompt_token_ids)
            self.metrics.observe_engine_metrics(out.metrics)
        return changed

    # -- results ---------------------------------------------------------------------

    @property
    def done(self) -> bool:
        """Every engine request has sent its final output."""
        return not self.unfinished

    def usage(self) -> Usage:
        """Tokens so far: prompts counted once each (not once per choice)."""
        return Usage(prompt_tokens=sum(self.prompt_tokens),
                     completion_tokens=sum(c.num_tokens for c in self.choices),
                     cached_tokens=sum(self.cached_tokens))

    def terminal_check(self) -> Optional[OpenAIError]:
        """See :func:`llmserve.server.responses.terminal_error`."""
        from llmserve.server.responses import terminal_error

        return terminal_error([c.finish_reason for c in self.choices],
                              [c.num_tokens for c in self.choices])

    async def consume(self) -> "GenerationRun":
        """Run to completion (non-streaming); returns self."""
        async for _ in self.deltas():
            pass
        return self

    async def finish(self, status: str, error: Optional[str] = None,
                     response: Optional[CapturedResponse] = None,
                     http_status: Optional[int] = None) -> None:
        """End the request exactly once: abort leftovers, release ids, notify the gateway.

        ``status``: "completed", "aborted" (client went away) or "error"; ``response``:
        the response as sent (given to the gateway when ``ctx.capture_response``);
        ``http_status``: the status sent (default ``response.status``; None when the
        client went away before any response).
        """
        if self._finished:
            return
        self._finished = True
        try:
            for i in sorted(self.unfinished):
                try:
                    await self.engine.abort(self.engine_ids[i])
                except Exception:  # noqa: BLE001 - best effort; the stream close aborts too
                    logger.exception("engine.abort(%s) failed", self.engine_ids[i])
        finally:
            self._release_ids(self.engine_ids)
            self.metrics.in_progress.dec()
            if status == "aborted":
                self.metrics.client_disconnects.inc()
            elif status == "completed":
                self.timer.on_request_done()
            outcome = RequestOutcome(status=status, usage=self.usage(),
                                     finish_reasons=[c.finish_reason for c in self.choices],
                                     error=error, served_model=self.served_model,
                                     fingerprint=getattr(self.engine, "fingerprint", None),
                                     started=self.started,
                                     http_status=http_status if http_status is not None else (
                                         response.status if response is not None else None),
                                     response=response if self.ctx.capture_response else None)
            await notify_complete(self.gateway, self.ctx, outcome)
