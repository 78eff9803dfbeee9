"""One admitted generation request in flight: engine streams in, choices accumulated.

:class:`GenerationRun` starts one engine request per prompt, merges their output
increments, keeps per-choice state (text, token counts, logprobs, finish reason),
feeds the latency metrics, tells the gateway when the engine first scheduled it
(``on_started``), and -- exactly once, in :meth:`GenerationRun.finish` -- aborts
whatever is still running in the engine, releases the request ids and tells the
gateway how the request ended (``on_complete``, awaited).

What the engine *computed* is tracked per prompt: a prompt counts once the engine
reports it scheduled (``RequestMetrics.first_scheduled_time``, or a token). A prompt
whose request ended before it was ever scheduled (a deadline or queue deadline that
passed in the queue, a client that left while it waited) computed nothing. For a
request cut short, the engine's answer to the abort (its final output, returned by
``engine.abort`` once the KV blocks are free) says whether it had been scheduled, and
the time from the cancel to that answer is observed as
``llmserve_cancel_to_kv_freed_seconds``.
"""
from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncGenerator, AsyncIterator, Callable, Optional

from llmserve.contract.engine_client import EmbeddingEngine, EngineClient
from llmserve.contract.errors import OpenAIError
from llmserve.contract.gateway_hook import (
    CapturedResponse,
    Gateway,
    OutcomeStatus,
    RequestContext,
    RequestOutcome,
    Usage,
    notify_complete,
    notify_started,
)
from llmserve.pooling_params import PoolingParams
from llmserve.protocol import RequestFailedError, RequestOutput, TokenLogprob
from llmserve.sampling_params import SamplingParams
from llmserve.server.errors import request_failed_to_openai, value_error_to_openai
from llmserve.server.metrics.prometheus import RequestTimer, ServerMetrics

logger = logging.getLogger(__name__)

_END = object()
#: Longest wait for the engine to confirm an abort before the request is ended anyway.
ABORT_CONFIRM_TIMEOUT_S = 10.0


@functools.lru_cache(maxsize=None)
def supports_queue_deadline(engine_type: type[EngineClient]) -> bool:
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
    accepted_prediction_tokens: Optional[int] = None   # Predicted Outputs (final output)
    rejected_prediction_tokens: Optional[int] = None

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
        engine: EngineClient,
        prompts: list[list[int]],
        params: SamplingParams,
        engine_ids: list[str],
        ctx: RequestContext,
        metrics: ServerMetrics,
        timer: RequestTimer,
        gateway: Optional[Gateway],
        release_ids: Callable[[list[str]], None],
        served_model: Optional[str] = None,
        prediction: Optional[str] = None,
        pooling: Optional[PoolingParams] = None,
    ) -> None:
        """``pooling``: an embedding request (``engine`` an EmbeddingEngine; ``params``
        unused but for ``n``, which must be 1): each prompt's vector lands in
        :attr:`embeddings`."""
        self.engine = engine
        self.pooling = pooling
        #: per prompt: its embedding, once the engine sent it (embedding requests)
        self.embeddings: list[Optional[list[float]]] = [None] * len(prompts)
        self.prediction = prediction   # Predicted Outputs text (chat), passed to the engine
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
        #: per prompt: its token logprobs (prompt_logprobs / echo requests), once they arrive
        self.prompt_logprobs: list[Optional[list]] = [None] * len(prompts)
        self.cached_tokens = [0] * len(prompts)
        self.unfinished = set(range(len(prompts)))
        #: per prompt: the engine scheduled it (True), never did (False), unknown (None)
        self.scheduled: list[Optional[bool]] = [None] * len(prompts)
        self.started = False
        self._finished = False
        self._aborted: set[int] = set()
        metrics.in_progress.inc()

    # -- engine side -------------------------------------------------------------------

    async def _open(self, prompt_idx: int) -> AsyncIterator[RequestOutput]:
        ctx = self.ctx
        kwargs: dict[str, Any] = {}
        if ctx.queue_deadline is not None and supports_queue_deadline(type(self.engine)):
            kwargs["queue_deadline"] = ctx.queue_deadline
        if self.prediction is not None:
            kwargs["prediction"] = self.prediction
        if self.pooling is not None:
            if not isinstance(self.engine, EmbeddingEngine):
                raise TypeError("this engine does not serve embeddings")
            stream = self.engine.embed(
                self.prompts[prompt_idx], self.pooling, self.engine_ids[prompt_idx],
                priority=ctx.priority, cache_salt=ctx.cache_salt, deadline=ctx.deadline,
                queue_deadline=ctx.queue_deadline)
        else:
            stream = self.engine.generate(
                self.prompts[prompt_idx], self.params, self.engine_ids[prompt_idx],
                priority=ctx.priority, cache_salt=ctx.cache_salt, deadline=ctx.deadline,
                **kwargs)
        if inspect.isawaitable(stream):  # an `async def` returning an iterator
            stream = await stream
        return stream

    async def _single(self) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        stream = await self._open(0)
        try:
            async for out in stream:
                yield 0, out
        finally:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()

    async def _merged(self) -> AsyncGenerator[tuple[int, RequestOutput], None]:
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

    async def deltas(self) -> AsyncGenerator[list[ChoiceDelta], None]:
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
            try:
                await source.aclose()
            finally:
                if self.unfinished:  # cut short (cancelled, client gone, failed)
                    await self.abort_unfinished()
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

    def _note_scheduled(self, prompt_idx: int, out: RequestOutput) -> None:
        """Update whether the engine scheduled this prompt from one of its outputs."""
        if self.scheduled[prompt_idx]:
            return
        m = out.metrics
        if (m is not None and m.first_scheduled_time is not None) or \
                any(c.num_tokens or c.token_ids for c in out.outputs):
            self.scheduled[prompt_idx] = True
        elif out.finished:
            if m is not None:
                self.scheduled[prompt_idx] = False
            else:  # an engine that reports no metrics: only a queue timeout ran nothing
                reasons = [c.finish_reason for c in out.outputs]
                self.scheduled[prompt_idx] = not (reasons and all(
                    str(getattr(r, "value", r)) == "queue_timeout" for r in reasons))

    def _apply(self, prompt_idx: int, out: RequestOutput, now: float) -> list[ChoiceDelta]:
        self._note_started(out)
        self._note_scheduled(prompt_idx, out)
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
                state.accepted_prediction_tokens = getattr(c, "accepted_prediction_tokens", None)
                state.rejected_prediction_tokens = getattr(c, "rejected_prediction_tokens", None)
                self.timer.on_choice_finished(state.index, state.num_tokens, state.finish_reason)
            changed.append(ChoiceDelta(state.index, c.text, c.logprobs,
                                       state.finish_reason if c.finish_reason else None,
                                       c.stop_reason, offset, new_tokens))
        if out.prompt_logprobs is not None:
            self.prompt_logprobs[prompt_idx] = out.prompt_logprobs
        if out.embedding is not None:
            self.embeddings[prompt_idx] = out.embedding
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

    def usage(self, computed: bool = False) -> Usage:
        """Tokens so far: prompts counted once each (not once per choice).

        ``computed``: only the prompts the engine scheduled (an unknown one counts), i.e.
        what the engine actually computed -- what the gateway bills.
        """
        prompts = [i for i in range(len(self.prompts))
                   if not computed or self.scheduled[i] is not False]
        usage = Usage(prompt_tokens=sum(self.prompt_tokens[i] for i in prompts),
                      completion_tokens=sum(c.num_tokens for c in self.choices),
                      cached_tokens=sum(self.cached_tokens[i] for i in prompts))
        if self.prediction is not None:
            usage.accepted_prediction_tokens = sum(c.accepted_prediction_tokens or 0
                                                   for c in self.choices)
            usage.rejected_prediction_tokens = sum(c.rejected_prediction_tokens or 0
                                                   for c in self.choices)
        return usage

    async def abort_unfinished(self) -> None:
        """Abort every prompt still in the engine and wait for the engine to confirm.

        An engine whose ``abort`` returns the request's final output (the KV blocks are
        free when it does) tells whether the prompt was ever scheduled; the wait is
        observed as ``llmserve_cancel_to_kv_freed_seconds``. Idempotent.
        """
        for i in sorted(self.unfinished - self._aborted):
            self._aborted.add(i)
            started = time.monotonic()
            try:
                final = await asyncio.wait_for(self.engine.abort(self.engine_ids[i]),
                                               ABORT_CONFIRM_TIMEOUT_S)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - best effort; the stream close aborts too
                logger.exception("engine.abort(%s) failed", self.engine_ids[i])
                continue
            if isinstance(final, RequestOutput):
                self.metrics.admission.cancel_to_kv_freed.observe(time.monotonic() - started)
                self._note_scheduled(i, final)
                if self.scheduled[i] and final.num_cached_tokens:
                    self.cached_tokens[i] = final.num_cached_tokens

    def terminal_check(self) -> Optional[OpenAIError]:
        """See :func:`llmserve.server.protocol.responses.terminal_error`; a terminal error is
        counted in ``llmserve_requests_rejected_total``."""
        from llmserve.server.protocol.responses import terminal_error

        err = terminal_error([c.finish_reason for c in self.choices],
                             [c.num_tokens for c in self.choices])
        if err is not None:
            self.metrics.admission.count_rejected(err.status, err.code)
        return err

    async def consume(self) -> "GenerationRun":
        """Run to completion (non-streaming); returns self."""
        async for _ in self.deltas():
            pass
        return self

    @staticmethod
    def _http_status(status: OutcomeStatus, given: Optional[int],
                     response: Optional[CapturedResponse]) -> Optional[int]:
        if given is not None:
            return given
        if status == OutcomeStatus.ABORTED or response is None:
            return None
        return response.status

    async def finish(self, status: OutcomeStatus, error: Optional[str] = None,
                     response: Optional[CapturedResponse] = None,
                     http_status: Optional[int] = None) -> None:
        """End the request exactly once: abort leftovers, release ids, notify the gateway.

        ``status``: "completed", "aborted" (client went away) or "error"; ``response``:
        the response as sent (given to the gateway when ``ctx.capture_response``; for
        a client that went away, the partial response stored for replay);
        ``http_status``: the status sent (default ``response.status``, but None for
        "aborted": the client went away before any response, whether or not a partial
        response is kept for replay).
        """
        if self._finished:
            return
        self._finished = True
        try:
            await self.abort_unfinished()
        finally:
            self._release_ids(self.engine_ids)
            self.metrics.in_progress.dec()
            if status == OutcomeStatus.ABORTED:
                self.metrics.client_disconnects.inc()
            elif status == OutcomeStatus.COMPLETED:
                self.timer.on_request_done()
            outcome = RequestOutcome(status=status, usage=self.usage(computed=True),
                                     finish_reasons=[c.finish_reason for c in self.choices],
                                     error=error, served_model=self.served_model,
                                     fingerprint=getattr(self.engine, "fingerprint", None),
                                     started=self.started,
                                     http_status=self._http_status(status, http_status, response),
                                     response=response if self.ctx.capture_response else None)
            await notify_complete(self.gateway, self.ctx, outcome)
