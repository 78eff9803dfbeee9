"""Turn a GenerationRun into SSE events (streaming) or one JSON body (non-streaming).

Chat streams follow OpenAI: per choice a first chunk whose delta carries the role,
then content deltas, then a chunk with an empty delta and the finish reason; with
``stream_options.include_usage`` every chunk has ``"usage": null`` and a last chunk
with empty ``choices`` carries the usage. Text-completion chunks carry ``text`` and,
on a choice's last chunk, its finish reason. The stream ends with ``data: [DONE]``.

Nothing is yielded until a first token exists (or the request has ended), so errors
raised before that -- including "every choice timed out without a token" -- are
sent as ordinary JSON error responses with their HTTP status.
"""
from __future__ import annotations

import logging
from typing import Any, AsyncIterator, Callable

from llmserve.server.errors import OpenAIError, error_body
from llmserve.server.generation import ChoiceDelta, GenerationRun
from llmserve.server.responses import (ResponseHeader, chat_choice, chat_chunk_choice,
                                       completion_choice)
from llmserve.server.sse import SSE_DONE, encode_event

logger = logging.getLogger(__name__)

ChunkMaker = Callable[[ChoiceDelta], list[dict[str, Any]]]


def _chat_chunks(want_logprobs: bool) -> ChunkMaker:
    def make(d: ChoiceDelta) -> list[dict[str, Any]]:
        out = []
        if d.text or (want_logprobs and d.logprobs):
            out.append(chat_chunk_choice(d.index, {"content": d.text}, None, d.logprobs,
                                         want_logprobs))
        if d.finish_reason is not None:
            out.append(chat_chunk_choice(d.index, {}, d.finish_reason, stop_reason=d.stop_reason))
        return out
    return make


def _completion_chunks(want_logprobs: bool) -> ChunkMaker:
    def make(d: ChoiceDelta) -> list[dict[str, Any]]:
        if d.text or d.finish_reason is not None or (want_logprobs and d.logprobs):
            return [completion_choice(d.index, d.text, d.finish_reason, d.logprobs,
                                      want_logprobs and bool(d.logprobs), d.text_offset,
                                      d.stop_reason)]
        return []
    return make


async def stream_events(
    run: GenerationRun, header: ResponseHeader, *, chat: bool, include_usage: bool,
    want_logprobs: bool,
) -> AsyncIterator[bytes]:
    """The SSE byte stream of one request; always ends the run via ``run.finish``."""
    extra = {"usage": None} if include_usage else {}
    make = _chat_chunks(want_logprobs) if chat else _completion_chunks(want_logprobs)
    started = False
    pending: list[dict[str, Any]] = []
    status, error = "aborted", None
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
                yield b"".join(encode_event(header.body([c], **extra)) for c in pending)
                pending = []
        if not started:  # the engine ended without a single increment
            err = run.terminal_check()
            if err is not None:
                raise err
            if chat:
                pending = [chat_chunk_choice(i, {"role": "assistant", "content": ""})
                           for i in range(len(run.choices))] + pending
            started = True
            if pending:
                yield b"".join(encode_event(header.body([c], **extra)) for c in pending)
        if include_usage:
            yield encode_event(header.body([], usage=run.usage().to_openai()))
        status = "completed"
        yield SSE_DONE
    except OpenAIError as err:
        status, error = "error", err.message
        if not started:
            raise
        logger.warning("stream %s failed after it started: %s", header.response_id, err.message)
        yield encode_event(err.body()) + SSE_DONE
    except Exception as exc:  # noqa: BLE001 - the client gets an error event, we log it
        status, error = "error", repr(exc)
        if not started:
            raise
        logger.exception("stream %s failed after it started", header.response_id)
        yield encode_event(error_body("internal error while streaming", "server_error",
                                      code="internal_error")) + SSE_DONE
    finally:
        try:
            await source.aclose()
        finally:
            await run.finish(status, error)


def chat_body(run: GenerationRun, header: ResponseHeader, want_logprobs: bool) -> dict[str, Any]:
    """The non-streamed chat completion."""
    choices = [chat_choice(c.index, c.text, c.finish_reason, c.logprobs, want_logprobs,
                           c.stop_reason) for c in run.choices]
    return header.body(choices, usage=run.usage().to_openai())


def completion_body(run: GenerationRun, header: ResponseHeader,
                    want_logprobs: bool) -> dict[str, Any]:
    """The non-streamed text completion."""
    choices = [completion_choice(c.index, c.text, c.finish_reason, c.logprobs, want_logprobs,
                                 0, c.stop_reason) for c in run.choices]
    return header.body(choices, usage=run.usage().to_openai())
