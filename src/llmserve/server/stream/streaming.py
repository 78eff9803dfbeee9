"""Turn a GenerationRun into SSE events (streaming) or one JSON body (non-streaming).

Chat streams follow OpenAI: per choice a first chunk whose delta carries the role,
then content deltas, then a chunk with an empty delta and the finish reason; with
``stream_options.include_usage`` every chunk has ``"usage": null`` and a last chunk
with empty ``choices`` carries the usage. Text-completion chunks carry ``text`` and,
on a choice's last chunk, its finish reason. The stream ends with ``data: [DONE]``.

Nothing is yielded until a first token exists (or the request has ended), so errors
raised before that -- including "every choice timed out without a token" -- are
sent as ordinary JSON error responses with their HTTP status.

With ``capture`` the stream keeps the payloads it sends, for the gateway's
idempotency store; see :func:`stream_events`.
"""
from __future__ import annotations

import json
import logging
from typing import Any, AsyncIterator, Callable, Optional, Sequence

from llmserve.contract.errors import OpenAIError, error_body
from llmserve.contract.gateway_hook import CapturedResponse, OutcomeStatus
from llmserve.server.generation import ChoiceDelta, GenerationRun
from llmserve.server.protocol.response_shaping import ResponseOptions, chat_choices, completion_choices
from llmserve.server.protocol.responses import ResponseHeader, chat_chunk_choice, completion_choice
from llmserve.server.reasoning.parsers import ReasoningStreamer
from llmserve.server.stream.sse import SSE_DONE, encode_event
from llmserve.tool_parsers import ToolCallDeltaStream

logger = logging.getLogger(__name__)

ChunkMaker = Callable[[ChoiceDelta], list[dict[str, Any]]]

#: Response header naming the served model that actually produced the response.
SERVED_BY_HEADER = "X-Served-By"
#: finish_reason of the closing chunk stored for a stream whose client went away.
ABORT_FINISH_REASON = "abort"


def _chat_chunks(opts: ResponseOptions) -> ChunkMaker:
    want_logprobs = opts.want_logprobs
    streamers: dict[int, ToolCallDeltaStream] = {}
    thinking: dict[int, ReasoningStreamer] = {}

    def make(d: ChoiceDelta) -> list[dict[str, Any]]:
        out = []
        text = d.text
        calls: list[dict[str, Any]] = []
        if opts.reasoning is not None:
            splitter = thinking.get(d.index)
            if splitter is None:
                splitter = thinking[d.index] = ReasoningStreamer(opts.reasoning)
            reasoning, text = splitter.feed(text, final=d.finish_reason is not None)
            if reasoning and opts.include_reasoning:
                out.append(chat_chunk_choice(d.index, {"reasoning_content": reasoning}))
        if opts.tools:
            streamer = streamers.get(d.index)
            if streamer is None:
                streamer = streamers[d.index] = opts.tool_parser.streamer(opts.tools)
            text, calls = streamer.feed(text, final=d.finish_reason is not None)
        if text or (want_logprobs and d.logprobs):
            out.append(chat_chunk_choice(d.index, {"content": text}, None, d.logprobs,
                                         want_logprobs))
        out.extend(chat_chunk_choice(d.index, {"tool_calls": [c]}) for c in calls)
        if d.finish_reason is not None:
            last = chat_chunk_choice(d.index, {}, d.finish_reason, stop_reason=d.stop_reason)
            if d.index in streamers and streamers[d.index].num_calls and \
                    last["finish_reason"] == "stop":
                last["finish_reason"] = "tool_calls"
            out.append(last)
        return out
    return make


def _completion_chunks(opts: ResponseOptions, run: GenerationRun) -> ChunkMaker:
    want_logprobs = opts.want_logprobs
    echoed: set[int] = set()

    def make(d: ChoiceDelta) -> list[dict[str, Any]]:
        text, logprobs, offset = d.text, d.logprobs, d.text_offset
        if opts.drop_output:
            text, logprobs = "", None
        if opts.echo:
            p = d.index // run.n
            prefix = opts.prompt_texts[p]
            offset += len(prefix)
            if d.index not in echoed:
                echoed.add(d.index)
                text, offset = prefix + text, 0
                logprobs = opts.echo_logprobs(run, p) + list(logprobs or [])
        if text or d.finish_reason is not None or (want_logprobs and logprobs):
            return [completion_choice(d.index, text, d.finish_reason, logprobs,
                                      want_logprobs and bool(logprobs), offset,
                                      None if opts.drop_output else d.stop_reason)]
        return []
    return make


class _StreamLog:
    """Encodes the events of one stream and, when asked, keeps their JSON payloads
    (exactly as sent) and which choices have already sent their finish reason."""

    def __init__(self, header: ResponseHeader, extra: dict[str, Any], capture: bool) -> None:
        self.header = header
        self.extra = extra
        self.payloads: Optional[list[str]] = [] if capture else None
        self.finished: set[int] = set()

    def encode(self, payload: dict[str, Any]) -> bytes:
        data = encode_event(payload)
        if self.payloads is not None:
            self.payloads.append(data[len(b"data: "):-2].decode("utf-8"))
        return data

    def chunks(self, choices: list[dict[str, Any]]) -> bytes:
        for c in choices:
            if c.get("finish_reason") is not None:
                self.finished.add(c["index"])
        return b"".join(self.encode(self.header.body([c], **self.extra)) for c in choices)

    def response(self, served_model: Optional[str], tail: Sequence[str] = ("[DONE]",)
                 ) -> Optional[CapturedResponse]:
        if self.payloads is None:
            return None
        headers = {"Content-Type": "text/event-stream"}
        if served_model:
            headers[SERVED_BY_HEADER] = served_model
        return CapturedResponse(200, headers, events=self.payloads + list(tail))


def _abort_tail(log: _StreamLog, run: GenerationRun, *, chat: bool, started: bool,
                include_usage: bool) -> list[str]:
    """The events that end a stream whose client went away (stored for replay, never
    sent): role chunks if nothing was sent yet (chat), a chunk with finish_reason
    ``"abort"`` for every choice that had not finished, the usage chunk when asked for,
    and ``[DONE]``."""
    def payload(body: dict[str, Any]) -> str:
        return json.dumps(body, separators=(",", ":"), ensure_ascii=False)

    tail = []
    if chat and not started:
        tail += [payload(log.header.body([chat_chunk_choice(i, {"role": "assistant", "content": ""})],
                                         **log.extra)) for i in range(len(run.choices))]
    for c in run.choices:
        if c.index in log.finished:
            continue
        if chat:
            choice = {"index": c.index, "delta": {}, "logprobs": None,
                      "finish_reason": ABORT_FINISH_REASON, "stop_reason": None}
        else:
            choice = {"index": c.index, "text": "", "logprobs": None,
                      "finish_reason": ABORT_FINISH_REASON, "stop_reason": None}
        tail.append(payload(log.header.body([choice], **log.extra)))
    if include_usage:
        tail.append(payload(log.header.body([], usage=run.usage().to_openai())))
    return tail + ["[DONE]"]


async def stream_events(
    run: GenerationRun, header: ResponseHeader, *, chat: bool, include_usage: bool,
    want_logprobs: bool, capture: bool = False, opts: Optional[ResponseOptions] = None,
) -> AsyncIterator[bytes]:
    """The SSE byte stream of one request; always ends the run via ``run.finish``.

    A stream that ends normally calls ``run.finish("completed")`` before it sends
    ``data: [DONE]``. With ``capture``, the events are kept and handed to
    ``run.finish`` (for the gateway): as sent, or, when the client went away, what
    was sent followed by :func:`_abort_tail`.
    """
    extra = {"usage": None} if include_usage else {}
    log = _StreamLog(header, extra, capture)
    opts = opts or ResponseOptions(want_logprobs=want_logprobs)
    make = _chat_chunks(opts) if chat else _completion_chunks(opts, run)
    started = False
    pending: list[dict[str, Any]] = []
    status: OutcomeStatus = OutcomeStatus.ABORTED
    error: Optional[str] = None
    response: Optional[CapturedResponse] = None
    source = run.deltas()
    try:
        async for deltas in source:
            for d in deltas:
                pending.extend(make(d))
            if not started:
                if not any(c.num_tokens for c in run.choices) and not run.done:
                    continue
                if run.done:
                    err = run.terminal_check()
                    if err is not None:
                        raise err
                started = True
                if chat:
                    roles = [chat_chunk_choice(i, {"role": "assistant", "content": ""})
                             for i in range(len(run.choices))]
                    pending = roles + pending
            if pending:
                data, pending = log.chunks(pending), []
                yield data
        if not started:  # the engine ended without a single increment
            err = run.terminal_check()
            if err is not None:
                raise err
            if chat:
                pending = [chat_chunk_choice(i, {"role": "assistant", "content": ""})
                           for i in range(len(run.choices))] + pending
            started = True
            if pending:
                yield log.chunks(pending)
        if include_usage:
            yield log.encode(header.body([], usage=_usage(run, opts)))
        status = OutcomeStatus.COMPLETED
        await run.finish(status, None, log.response(run.served_model), 200)
        yield SSE_DONE
    except OpenAIError as err:
        status, error = OutcomeStatus.ERROR, err.message
        if not started:
            response = CapturedResponse(err.status, dict(err.headers), body=err.body())
            raise
        logger.warning("stream %s failed after it started: %s", header.response_id, err.message)
        data = log.encode(err.body()) + SSE_DONE
        response = log.response(run.served_model)
        yield data
    except Exception as exc:  # noqa: BLE001 - the client gets an error event, we log it
        status, error = OutcomeStatus.ERROR, repr(exc)
        if not started:
            raise
        logger.exception("stream %s failed after it started", header.response_id)
        data = log.encode(error_body("internal error while streaming", "server_error",
                                     code="internal_error")) + SSE_DONE
        response = log.response(run.served_model)
        yield data
    finally:
        try:
            await source.aclose()
        finally:
            if status == OutcomeStatus.ABORTED and log.payloads is not None:
                response = log.response(run.served_model, _abort_tail(
                    log, run, chat=chat, started=started, include_usage=include_usage))
            if started:
                http_status: Optional[int] = 200     # the headers went out
            elif status == OutcomeStatus.ABORTED:
                http_status = None                   # the client left before any response
            else:
                http_status = response.status if response is not None else (
                    500 if status == OutcomeStatus.ERROR else None)
            await run.finish(status, error, response, http_status)


def _usage(run: GenerationRun, opts: ResponseOptions) -> dict[str, Any]:
    usage = run.usage().to_openai()
    if opts.drop_output:  # max_tokens 0: the token generated to end the request is not sent
        usage["completion_tokens"] = 0
        usage["total_tokens"] = usage["prompt_tokens"]
    return usage


def chat_body(run: GenerationRun, header: ResponseHeader,
              opts: ResponseOptions) -> dict[str, Any]:
    """The non-streamed chat completion."""
    return header.body(chat_choices(run, opts), usage=_usage(run, opts))


def completion_body(run: GenerationRun, header: ResponseHeader,
                    opts: ResponseOptions) -> dict[str, Any]:
    """The non-streamed text completion."""
    return header.body(completion_choices(run, opts), usage=_usage(run, opts))
