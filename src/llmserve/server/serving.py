"""The request path of /v1/chat/completions and /v1/completions.

authenticate (gateway) -> read + validate body -> resolve model -> tokenize (in a
worker thread) -> context-length check -> SamplingParams -> reserve engine ids ->
admit (gateway) -> GenerationRun -> SSE stream or JSON body.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional, Sequence, TypeVar, Union

from fastapi import Request
from fastapi.responses import JSONResponse

from llmserve.sampling_params import SamplingParams
from llmserve.server.errors import OpenAIError, bad_request, value_error_to_openai
from llmserve.server.gateway_hook import RequestContext, call_hook
from llmserve.server.generation import GenerationRun
from llmserve.server.metrics import RequestTimer, ServerMetrics
from llmserve.server.openai_protocol import (MAX_CHOICES_PER_REQUEST, ChatCompletionRequest,
                                             CompletionRequest, make_sampling_params,
                                             parse_request)
from llmserve.server.responses import ResponseHeader
from llmserve.server.sse import ClientDisconnected, EventStreamResponse, run_until_disconnect
from llmserve.server.streaming import chat_body, completion_body, stream_events

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Largest request body accepted (bytes); a 128k-token id list is about 1 MiB of JSON.
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
#: Bodies larger than this are decoded and validated in a worker thread.
_PARSE_INLINE_BYTES = 64 * 1024


async def read_body(request: Request, limit: int) -> bytes:
    """The whole request body, or a 413 once it exceeds ``limit`` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise OpenAIError(413, f"Request body too large (limit {limit} bytes)",
                          code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise OpenAIError(413, f"Request body too large (limit {limit} bytes)",
                              code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


class OpenAIServing:
    """Serves the two generation endpoints for one engine."""

    def __init__(self, engine: Any, metrics: ServerMetrics, served_model_names: Sequence[str],
                 gateway: Any = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        if not served_model_names:
            raise ValueError("served_model_names must not be empty")
        self.engine = engine
        self.metrics = metrics
        self.served_model_names = list(served_model_names)
        self.gateway = gateway
        self.max_body_bytes = max_body_bytes
        self._inflight: set[str] = set()
        self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="llmserve-tokenize")

    def close(self) -> None:
        """Stop the tokenizer threads."""
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def _in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    # -- steps ---------------------------------------------------------------------

    def resolve_model(self, requested: Optional[str]) -> str:
        """The served name to answer as; a missing model means the default (first) one."""
        if not requested:
            return self.served_model_names[0]
        if requested not in self.served_model_names:
            raise OpenAIError(404, f"The model `{requested}` does not exist",
                              param="model", code="model_not_found")
        return requested

    def _chat_prompt(self, messages: list[dict[str, Any]]) -> list[int]:
        tok = self.engine.tokenizer
        text = tok.apply_chat_template(messages, add_generation_prompt=True)
        return list(tok.encode(text, add_special_tokens=False))

    def _text_prompts(self, prompts: list[Union[str, list[int]]]) -> list[list[int]]:
        tok = self.engine.tokenizer
        vocab = getattr(tok, "vocab_size", None)
        if not isinstance(vocab, int) and hasattr(tok, "__len__"):
            vocab = len(tok)
        out = []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                out.append(list(tok.encode(p, add_special_tokens=True)))
                continue
            for t in p:
                if t < 0 or (isinstance(vocab, int) and t >= vocab):
                    where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
                    raise bad_request(f"{where} contains token id {t} outside the vocabulary"
                                      + (f" [0, {vocab})" if isinstance(vocab, int) else ""),
                                      param="prompt")
            out.append(list(p))
        return out

    def _resolve_max_tokens(self, requested: Optional[int], field: str, longest: int,
                            what: str) -> int:
        limit = self.engine.max_model_len
        if requested is None:
            remaining = limit - longest
            if remaining < 1:
                raise bad_request(
                    f"This model's maximum context length is {limit} tokens. However, your "
                    f"{what} use {longest} tokens, leaving no room for the completion. "
                    f"Please reduce the length of the {what}.",
                    param=what, code="context_length_exceeded")
            return remaining
        if requested >= 1 and longest + requested > limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {longest + requested} tokens ({longest} in the {what}, {requested} "
                f"in the completion). Please reduce the length of the {what} or completion.",
                param=field, code="context_length_exceeded")
        return requested

    def _reserve_ids(self, base: str, count: int) -> tuple[str, list[str]]:
        """A base id not in flight (``base`` or ``base-<random>``) and the engine ids of
        its prompts (the base itself for one prompt, ``base-<i>`` for several)."""
        def ids_for(b: str) -> list[str]:
            return [b] if count == 1 else [f"{b}-{i}" for i in range(count)]

        unique, ids = base, ids_for(base)
        while any(i in self._inflight for i in ids):
            unique = f"{base}-{uuid.uuid4().hex[:8]}"
            ids = ids_for(unique)
        self._inflight.update(ids)
        return unique, ids

    def _release_ids(self, ids: list[str]) -> None:
        self._inflight.difference_update(ids)

    # -- the endpoint ----------------------------------------------------------------

    async def handle(self, request: Request, *, chat: bool) -> Any:
        """Serve one chat or text completion request."""
        state = request.scope.setdefault("state", {})
        request_id = state.get("request_id") or uuid.uuid4().hex
        arrival = state.get("arrival_monotonic", time.monotonic())
        ctx = RequestContext(
            request_id=request_id, endpoint="chat.completions" if chat else "completions",
            headers={k.lower(): v for k, v in request.headers.items()},
            client=request.client.host if request.client else None,
            arrival_time=state.get("arrival_time", time.time()))
        await call_hook(self.gateway, "authenticate", ctx)

        body = await read_body(request, self.max_body_bytes)
        model_cls = ChatCompletionRequest if chat else CompletionRequest
        if len(body) > _PARSE_INLINE_BYTES:  # big JSON: parse off the event loop
            req: Any = await self._in_thread(parse_request, model_cls, body)
        else:
            req = parse_request(model_cls, body)
        model = self.resolve_model(req.model)
        requested, max_field = req.requested_max_tokens
        num_logprobs = req.num_logprobs if chat else req.logprobs
        params = make_sampling_params(req, requested, max_field, num_logprobs, chat=chat)

        if chat:
            messages = [m.to_template_dict(i) for i, m in enumerate(req.messages)]
            try:
                prompts = [await self._in_thread(self._chat_prompt, messages)]
            except ValueError as exc:
                raise bad_request(f"Invalid messages: {exc}", param="messages") from None
            what = "messages"
        else:
            prompts = await self._in_thread(self._text_prompts, req.prompt_list())
            what = "prompt"
        if any(not p for p in prompts):
            raise bad_request(f"the {what} encode to zero tokens", param=what)
        if len(prompts) * params.n > MAX_CHOICES_PER_REQUEST:
            raise bad_request(f"prompts x n must be at most {MAX_CHOICES_PER_REQUEST}",
                              param="n")
        longest = max(len(p) for p in prompts)
        max_tokens = self._resolve_max_tokens(requested, max_field, longest, what)
        if max_tokens != params.max_tokens:
            try:
                params = dataclasses.replace(params, max_tokens=max_tokens)
            except ValueError as exc:
                raise value_error_to_openai(exc) from None

        ctx.request_id, engine_ids = self._reserve_ids(request_id, len(prompts))
        try:
            ctx.model, ctx.user, ctx.stream = model, req.user, bool(req.stream)
            ctx.prompt_tokens = sum(len(p) for p in prompts)
            ctx.max_tokens, ctx.num_choices = max_tokens, len(prompts) * params.n
            if req.priority is not None:
                ctx.priority = req.priority
            await call_hook(self.gateway, "admit", ctx)
        except BaseException:
            self._release_ids(engine_ids)
            raise
        return await self._run(request, ctx, prompts, params, engine_ids, model, chat=chat,
                               req=req, arrival=arrival)

    async def _run(self, request: Request, ctx: RequestContext, prompts: list[list[int]],
                   params: SamplingParams, engine_ids: list[str], model: str, *, chat: bool,
                   req: Any, arrival: float) -> Any:
        run = GenerationRun(self.engine, prompts, params, engine_ids, ctx, self.metrics,
                            RequestTimer(self.metrics, arrival), self.gateway, self._release_ids)
        prefix, obj = ("chatcmpl", "chat.completion") if chat else ("cmpl", "text_completion")
        want_logprobs = bool(req.logprobs) if chat else req.logprobs is not None
        header = ResponseHeader(f"{prefix}-{ctx.request_id}",
                                obj + ".chunk" if chat and req.stream else obj,
                                int(time.time()), model, self.engine.fingerprint)
        if req.stream:
            events = stream_events(run, header, chat=chat, include_usage=req.include_usage,
                                   want_logprobs=want_logprobs)
            return EventStreamResponse(events, on_close=lambda: run.finish("aborted"))
        try:
            await run_until_disconnect(run.consume(), request.receive)
        except ClientDisconnected:
            await run.finish("aborted")
            raise
        except BaseException as exc:
            await run.finish("error", repr(exc))
            raise
        err = run.terminal_check()
        await run.finish("completed" if err is None else "error",
                         None if err is None else err.message)
        if err is not None:
            raise err
        body = chat_body(run, header, want_logprobs) if chat else completion_body(
            run, header, want_logprobs)
        return JSONResponse(body)
