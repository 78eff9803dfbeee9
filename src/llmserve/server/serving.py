"""The request path of /v1/chat/completions and /v1/completions.

authenticate (gateway) -> size check and preadmit (gateway: rate limits from the raw
size, before the body is parsed) -> read body (size cap, read timeout) -> validate
body -> resolve model -> prepare (gateway; may answer with a stored response) ->
tokenize (worker threads shared fairly among tenants) -> context-length check ->
SamplingParams -> reserve engine ids -> admit (gateway; may pick another served model)
-> GenerationRun on that model's engine -> SSE stream or JSON body. An authenticated
request that fails before admission is reported to the gateway's ``on_reject``; every
error answer is counted in ``llmserve_requests_rejected_total``. See
:mod:`llmserve.contract.gateway_hook` and :mod:`llmserve.server.limits`.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from typing import Any, Callable, Mapping, Optional, Sequence, TypeVar, Union

from fastapi import Request
from fastapi.responses import JSONResponse

from llmserve.contract.engine_client import EngineClient
from llmserve.contract.errors import INCOMPATIBLE_PARAMETERS, OpenAIError, bad_request
from llmserve.contract.gateway_hook import CapturedResponse, Gateway, OutcomeStatus, RequestContext, call_hook, notify
from llmserve.contract.server_limits import PARSE_INLINE_BYTES, ServerLimits
from llmserve.sampling_params import SamplingParams
from llmserve.server.errors import value_error_to_openai
from llmserve.server.fair_pool import FairThreadPool
from llmserve.server.generation import GenerationRun
from llmserve.server.headers import unsendable_header
from llmserve.server.limits import DEFAULT_LIMITS, RequestLimits, check_token_ids
from llmserve.server.metrics.prometheus import RequestTimer, ServerMetrics
from llmserve.server.model_formats import ModelFormats
from llmserve.server.protocol.openai import (
    MAX_CHOICES_PER_REQUEST,
    ChatCompletionRequest,
    CompletionRequest,
    make_sampling_params,
    parse_request,
)
from llmserve.server.protocol.response_shaping import ResponseOptions, fim_prompt
from llmserve.server.protocol.responses import ResponseHeader
from llmserve.server.sampling_defaults import apply_sampling_defaults
from llmserve.server.stream.sse import ClientDisconnected, EventStreamResponse, replay_response, run_until_disconnect
from llmserve.server.stream.streaming import SERVED_BY_HEADER, chat_body, completion_body, stream_events
from llmserve.tokenizer.chat_prompt import chat_prompt_tokens

logger = logging.getLogger(__name__)

T = TypeVar("T")

def _too_large(limit: int) -> OpenAIError:
    return OpenAIError(413, f"Request body too large (limit {limit} bytes)", code="request_too_large")


def declared_length(request: Request) -> Optional[int]:
    """The body size the client declared in ``Content-Length`` (None if absent or malformed)."""
    declared = request.headers.get("content-length")
    return int(declared) if declared is not None and declared.isdigit() else None


async def read_body(request: Request, limit: int, timeout_s: Optional[float] = None,
                    started: Optional[float] = None) -> bytes:
    """The whole request body (a declared ``Content-Length`` is checked by the caller),
    or a 413 once it exceeds ``limit`` bytes, or a 408
    (``body_read_timeout``, with ``Connection: close``) when it has not fully arrived
    ``timeout_s`` seconds after ``started`` (``time.monotonic()``, default now)."""
    chunks, size = [], 0
    remaining = None
    if timeout_s is not None:
        remaining = max(0.0, (time.monotonic() if started is None else started) + timeout_s
                        - time.monotonic())
    try:
        async with asyncio.timeout(remaining):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise _too_large(limit)
                chunks.append(chunk)
    except TimeoutError:
        raise OpenAIError(408, f"The request body did not arrive within {timeout_s:g} s",
                          code="body_read_timeout", headers={"Connection": "close"}) from None
    return b"".join(chunks)


class OpenAIServing:
    """Serves the two generation endpoints for one engine."""

    def __init__(self, engine: EngineClient, metrics: ServerMetrics, served_model_names: Sequence[str],
                 gateway: Optional[Gateway] = None, max_body_bytes: Optional[int] = None,
                 engines: Optional[Mapping[str, EngineClient]] = None,
                 limits: Optional[ServerLimits] = None,
                 input_limits: RequestLimits = DEFAULT_LIMITS,
                 tool_call_parser: str = "auto", reasoning_parser: str = "auto") -> None:
        if not served_model_names:
            raise ValueError("served_model_names must not be empty")
        self.engine = engine
        self.metrics = metrics
        #: served model name -> engine: ``served_model_names`` name ``engine``, ``engines`` more.
        self.engines: dict[str, EngineClient] = {name: engine for name in served_model_names}
        for name, other in (engines or {}).items():
            if name in self.engines:
                raise ValueError(f"served model name {name!r} is given twice")
            self.engines[name] = other
        self.served_model_names = list(self.engines)
        self.gateway = gateway
        self.limits = (limits or ServerLimits()).replace(max_body_bytes=max_body_bytes)
        self.max_body_bytes = self.limits.max_body_bytes
        self.input_limits = input_limits
        self._inflight: set[str] = set()
        self.tokenizer_pool = FairThreadPool(self.limits.tokenizer_threads)
        #: each served model's tool-call format and reasoning parser
        self.formats = ModelFormats(tool_call_parser, reasoning_parser)
        for name, eng in self.engines.items():   # logged once per template at start-up
            self.formats.tool_parser(eng, name)
            self.formats.reasoning_parser(eng, name)

    def close(self) -> None:
        """Stop the tokenizer threads."""
        self.tokenizer_pool.shutdown()

    async def in_thread(self, ctx: RequestContext, fn: Callable[..., T], *args: Any) -> T:
        """Run blocking work on the pool, in the line of the request's tenant (or client)."""
        return await self.tokenizer_pool.run(ctx.tenant or ctx.client or "", fn, *args)

    # -- steps ---------------------------------------------------------------------

    def resolve_model(self, requested: Optional[str]) -> str:
        """The served name to answer as; a missing model means the default (first) one."""
        if not requested:
            return self.served_model_names[0]
        public = getattr(self.gateway, "public_models", None)
        if requested not in self.served_model_names and not (
                callable(public) and requested in public()):
            raise OpenAIError(404, f"The model `{requested}` does not exist",
                              param="model", code="model_not_found")
        return requested

    def _chat_prompt(self, engine: EngineClient, messages: list[dict[str, Any]],
                     tools: Optional[list[dict]] = None) -> list[int]:
        return chat_prompt_tokens(engine.tokenizer, messages, True, tools,
                                  self.formats.tool_parser(engine))

    def _text_prompts(self, engine: EngineClient, prompts: list[Union[str, list[int]]],
                      suffix: Optional[str] = None) -> list[list[int]]:
        tok = engine.tokenizer
        if suffix:  # fill-in-the-middle (a 400 without FIM tokens); "" is no suffix
            if not all(isinstance(p, str) for p in prompts):
                raise bad_request("suffix needs text prompts", param="suffix",
                                  code=INCOMPATIBLE_PARAMETERS)
            return [fim_prompt(tok, p, suffix) for p in prompts]  # type: ignore[arg-type]
        out = []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                out.append(list(tok.encode(p, add_special_tokens=True)))
                continue
            check_token_ids(tok, p, "prompt" if len(prompts) == 1 else f"prompt[{i}]", "prompt")
            out.append(list(p))
        return out

    def _resolve_max_tokens(self, engine: EngineClient, requested: Optional[int], field: str,
                            longest: int, what: str) -> int:
        limit = engine.max_model_len
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

    def reserve_ids(self, base: str, count: int) -> tuple[str, list[str]]:
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

    def release_ids(self, ids: list[str]) -> None:
        self._inflight.difference_update(ids)

    # -- the endpoint ----------------------------------------------------------------

    async def authenticated_context(self, request: Request, endpoint: str
                                    ) -> tuple[RequestContext, float]:
        """(the request's context, its arrival on the monotonic clock) after the gateway's
        ``authenticate``; a refusal is counted in the rejected requests and raised."""
        state = request.scope.setdefault("state", {})
        ctx = RequestContext(
            request_id=state.get("request_id") or uuid.uuid4().hex, endpoint=endpoint,
            headers={k.lower(): v for k, v in request.headers.items()},
            client=request.client.host if request.client else None,
            arrival_time=state.get("arrival_time", time.time()))
        try:
            await call_hook(self.gateway, "authenticate", ctx)
        except OpenAIError as err:
            self.metrics.admission.count_rejected(err.status, err.code)
            raise
        return ctx, state.get("arrival_monotonic", time.monotonic())

    @staticmethod
    def response_headers(ctx: RequestContext, served: str) -> dict[str, str]:
        """The response's headers (the served model, the gateway's); a 500 before anything
        runs, is billed or stored when one of them cannot be sent."""
        headers = {SERVED_BY_HEADER: served, **ctx.response_headers}
        bad_header = unsendable_header(headers)
        if bad_header is not None:
            raise OpenAIError(500, f"the response header {bad_header} cannot be sent",
                              code="internal_error")
        return headers

    async def refused(self, ctx: RequestContext, exc: BaseException,
                      engine_ids: list[str]) -> None:
        """A request that failed before it ran: its engine ids released, an error answer
        counted, the gateway's ``on_reject`` told."""
        self.release_ids(engine_ids)
        if isinstance(exc, OpenAIError):
            self.metrics.admission.count_rejected(exc.status, exc.code)
        await notify(self.gateway, "on_reject", ctx, exc)

    async def handle(self, request: Request, *, chat: bool) -> Any:
        """Serve one chat or text completion request."""
        state = request.scope.setdefault("state", {})
        ctx, arrival = await self.authenticated_context(
            request, "chat.completions" if chat else "completions")
        request_id = ctx.request_id
        engine_ids: list[str] = []
        try:
            req, prompts, params, max_tokens = await self._prepare(request, ctx, arrival,
                                                                   chat=chat)
            if ctx.replay is not None:
                if ctx.replay.request_id:
                    state["response_request_id"] = ctx.replay.request_id
                return replay_response(ctx.replay)
            ctx.request_id, engine_ids = self.reserve_ids(request_id, len(prompts))
            ctx.max_tokens, ctx.num_choices = max_tokens, len(prompts) * params.n
            if req.priority is not None:
                ctx.priority = req.priority
            await call_hook(self.gateway, "admit", ctx)
            served = ctx.served_model or ctx.model
            if served not in self.engines:
                raise OpenAIError(500, f"the gateway chose model {served!r}, which is not served",
                                  code="internal_error")
            headers = self.response_headers(ctx, served)
        except BaseException as exc:
            await self.refused(ctx, exc, engine_ids)
            raise
        return await self._run(request, ctx, prompts, params, engine_ids, served, headers,
                               chat=chat, req=req, arrival=arrival)

    async def read_request(self, request: Request, ctx: RequestContext, arrival: float) -> bytes:
        """Size check and ``preadmit`` from the raw size, then the body (413 / 408).

        ``preadmit`` runs before the body is read when ``Content-Length`` was declared,
        else right after reading it (the read itself is capped by ``max_body_bytes``).
        """
        limit = self.limits.max_body_bytes
        declared = declared_length(request)
        if declared is not None:
            if declared > limit:
                raise _too_large(limit)
            ctx.body_bytes = declared
            await call_hook(self.gateway, "preadmit", ctx)
        body = await read_body(request, limit, self.limits.body_read_timeout_s, arrival)
        if declared is None:
            ctx.body_bytes = len(body)
            await call_hook(self.gateway, "preadmit", ctx)
        return body

    async def _prepare(self, request: Request, ctx: RequestContext, arrival: float, *,
                       chat: bool) -> tuple[Any, list[list[int]], SamplingParams, int]:
        """Read, validate and tokenize the request; calls the gateway's ``preadmit`` and
        ``prepare``.

        Returns the parsed request, the prompts' token ids, the sampling parameters and
        max_tokens. Returns early (prompts empty) when the gateway set ``ctx.replay``.
        """
        body = await self.read_request(request, ctx, arrival)
        model_cls = ChatCompletionRequest if chat else CompletionRequest
        if len(body) > PARSE_INLINE_BYTES:  # big JSON: parse off the event loop
            req: Any = await self.in_thread(ctx, parse_request, model_cls, body,
                                             self.input_limits)
        else:
            req = parse_request(model_cls, body, self.input_limits)
        model = self.resolve_model(req.model)
        ctx.model, ctx.user, ctx.stream, ctx.raw_body = model, req.user, bool(req.stream), body
        await call_hook(self.gateway, "prepare", ctx)
        if ctx.replay is not None:
            return req, [], SamplingParams(), 0
        engine = self.engines.get(ctx.served_model or model)
        if engine is None:
            raise OpenAIError(500, f"the gateway chose model {ctx.served_model!r}, which is not "
                              "served", code="internal_error")
        apply_sampling_defaults(req, ctx.sampling_defaults)
        if chat:
            req.use_tool_parser(self.formats.tool_parser(engine))
            req.use_reasoning_parser(self.formats.reasoning_parser(engine))
        requested, max_field = req.requested_max_tokens
        num_logprobs = req.num_logprobs if chat else req.logprobs
        params = make_sampling_params(req, requested, max_field, num_logprobs, chat=chat)

        if chat:
            messages = [m.to_template_dict(i) for i, m in enumerate(req.messages)]
            if req.prompt_bundle is not None:
                if ctx.prefix_messages is None:
                    raise bad_request("prompt_bundle needs the gateway (serve with --config)",
                                      param="prompt_bundle", code="prompt_bundles_not_enabled")
                messages = list(ctx.prefix_messages) + messages
                req.merge_bundle_tools(ctx.prefix_tools)   # the bundle's, then its own
                params = dataclasses.replace(
                    params, structured_output=req.output_spec,
                    skip_special_tokens=req.sampling_kwargs().get("skip_special_tokens",
                                                                  params.skip_special_tokens))
            try:
                prompts = [await self.in_thread(ctx, self._chat_prompt, engine, messages,
                                                 req.checked_tools)]
            except ValueError as exc:
                raise bad_request(f"Invalid messages: {exc}", param="messages") from None
            what = "messages"
            params = self.formats.with_thinking_budget(req.thinking_budget, params,
                                                       engine)
        else:
            prompts = await self.in_thread(ctx, self._text_prompts, engine, req.prompt_list(),
                                            req.suffix)
            what = "prompt"
        ctx.prompt_token_ids, ctx.sampling_params = prompts, params
        ctx.prompt_tokens = sum(len(p) for p in prompts)
        ctx.longest_prompt_tokens = max((len(p) for p in prompts), default=0)
        ctx.max_tokens_requested = requested
        if any(not p for p in prompts):
            raise bad_request(f"the {what} encode to zero tokens", param=what)
        if len(prompts) * params.n > MAX_CHOICES_PER_REQUEST:
            raise bad_request(f"prompts x n must be at most {MAX_CHOICES_PER_REQUEST}",
                              param="n", code=INCOMPATIBLE_PARAMETERS)
        longest = max(len(p) for p in prompts)
        max_tokens = self._resolve_max_tokens(engine, requested, max_field, longest, what)
        if max_tokens != params.max_tokens:
            try:
                params = dataclasses.replace(params, max_tokens=max_tokens)
            except ValueError as exc:   # min_tokens beyond the room the prompt leaves
                err = value_error_to_openai(exc)
                err.code = "context_length_exceeded"
                raise err from None
        ctx.sampling_params = params
        return req, prompts, params, max_tokens

    async def _run(self, request: Request, ctx: RequestContext, prompts: list[list[int]],
                   params: SamplingParams, engine_ids: list[str], served: str,
                   headers: dict[str, str], *, chat: bool, req: Any, arrival: float) -> Any:
        engine = self.engines[served]
        run = GenerationRun(engine, prompts, params, engine_ids, ctx, self.metrics,
                            RequestTimer(self.metrics, arrival), self.gateway, self.release_ids,
                            served_model=served,
                            prediction=req.prediction_text if chat else None)
        prefix, obj = ("chatcmpl", "chat.completion") if chat else ("cmpl", "text_completion")
        want_logprobs = bool(req.logprobs) if chat else req.logprobs is not None
        opts = ResponseOptions.from_request(req, chat, [
            p if isinstance(p, str) else engine.tokenizer.decode(p, skip_special_tokens=False)
            for p in req.prompt_list()] if not chat and req.echo else [], engine.tokenizer)
        header = ResponseHeader(f"{prefix}-{ctx.request_id}",
                                obj + ".chunk" if chat and req.stream else obj,
                                int(time.time()), served, engine.fingerprint)
        if req.stream:
            events = stream_events(run, header, chat=chat, include_usage=req.include_usage,
                                   want_logprobs=want_logprobs, capture=ctx.capture_response,
                                   opts=opts)
            return EventStreamResponse(events, headers=headers,
                                       on_close=lambda: run.finish(OutcomeStatus.ABORTED))
        try:
            await run_until_disconnect(run.consume(), request.receive)
        except ClientDisconnected:
            partial = None
            if ctx.capture_response:  # what the client would have got, cut short
                partial = CapturedResponse(200, {"Content-Type": "application/json", **headers},
                                           body=self._body(run, header, chat, opts,
                                                           aborted=True))
            await run.finish(OutcomeStatus.ABORTED, response=partial)
            raise
        except BaseException as exc:
            await run.finish(OutcomeStatus.ERROR, repr(exc),
                             http_status=None if isinstance(exc, asyncio.CancelledError) else 500)
            raise
        err = run.terminal_check()
        if err is not None:
            await run.finish(OutcomeStatus.ERROR, err.message,
                             CapturedResponse(err.status, dict(err.headers), body=err.body()))
            raise err
        try:   # encoded before it is billed or stored: what cannot be sent is neither
            body = self._body(run, header, chat, opts)
            response = JSONResponse(body, headers=headers)
        except Exception as exc:  # noqa: BLE001 - answered as a 500, recorded as one
            logger.exception("request %s: the response could not be encoded", ctx.request_id)
            await run.finish(OutcomeStatus.ERROR, f"response not encodable: {exc!r}",
                             http_status=500)
            raise OpenAIError(500, "the response could not be encoded", code="internal_error",
                              ) from None
        await run.finish(OutcomeStatus.COMPLETED, None,
                         CapturedResponse(200, {"Content-Type": "application/json", **headers},
                                          body=body))
        return response

    @staticmethod
    def _body(run: GenerationRun, header: ResponseHeader, chat: bool, opts: ResponseOptions,
              aborted: bool = False) -> dict[str, Any]:
        """The JSON body; ``aborted``: unfinished choices get finish_reason ``"abort"``."""
        body = chat_body(run, header, opts) if chat else completion_body(run, header, opts)
        if aborted:
            for choice, state in zip(body["choices"], run.choices):
                if state.finish_reason is None:
                    choice["finish_reason"] = "abort"
        return body
