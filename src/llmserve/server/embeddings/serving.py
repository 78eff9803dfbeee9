"""The request path of ``POST /v1/embeddings`` (no torch).

The same path as a completion, over the pieces of :class:`OpenAIServing`: authenticate
(gateway) -> preadmit from the raw size -> read and validate the body -> resolve the
model -> prepare (gateway; may replay) -> tokenize on the fair pool -> context-length
check -> reserve engine ids -> admit (gateway: ``max_tokens`` 0, one "choice" per input)
-> one prefill-only engine request per input (:class:`GenerationRun` with pooling) ->
the JSON body. ``on_complete`` gets the prompt tokens as usage and zero completion
tokens, so the gateway bills an embedding like a prompt that generated nothing.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Optional, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from llmserve.contract.engine_client import EmbeddingEngine, EngineClient
from llmserve.contract.errors import OpenAIError, bad_request
from llmserve.contract.gateway_hook import CapturedResponse, OutcomeStatus, RequestContext, call_hook
from llmserve.contract.server_limits import PARSE_INLINE_BYTES
from llmserve.pooling_params import PoolingParams
from llmserve.protocol import FinishReason
from llmserve.sampling_params import SamplingParams
from llmserve.server.embeddings.request import INPUT_HINT, EmbeddingRequest, embeddings_body
from llmserve.server.errors import validation_error_to_openai
from llmserve.server.generation import GenerationRun
from llmserve.server.limits import check_token_ids
from llmserve.server.metrics.prometheus import RequestTimer
from llmserve.server.protocol.openai import body_text
from llmserve.server.protocol.responses import terminal_error
from llmserve.server.serving import OpenAIServing
from llmserve.server.stream.sse import ClientDisconnected, replay_response, run_until_disconnect

logger = logging.getLogger(__name__)


def parse_embedding_request(body: bytes) -> EmbeddingRequest:
    """The body as an :class:`EmbeddingRequest` (400 naming the field otherwise)."""
    from pydantic import ValidationError

    text = body_text(body)
    try:
        return EmbeddingRequest.model_validate_json(text)
    except ValidationError as exc:
        raise validation_error_to_openai(exc.errors(include_url=False),
                                         {"input": INPUT_HINT}) from None


def _token_ids(engine: EngineClient, inputs: list[Union[str, list[int]]],
               truncate: Optional[int]) -> list[list[int]]:
    """Each input's tokens (text as a completion prompt is encoded), cut to the last
    ``truncate`` tokens when asked (-1: the context length)."""
    tok = engine.tokenizer
    keep = engine.max_model_len if truncate == -1 else truncate
    out = []
    for i, item in enumerate(inputs):
        if isinstance(item, str):
            ids = list(tok.encode(item, add_special_tokens=True))
        else:
            check_token_ids(tok, item, "input" if len(inputs) == 1 else f"input[{i}]", "input")
            ids = list(item)
        out.append(ids[-keep:] if keep is not None else ids)
    return out


class EmbeddingsEndpoint:
    """``POST /v1/embeddings`` over the server's engines, gateway and metrics."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving
        self.metrics = serving.metrics
        self.gateway = serving.gateway

    async def handle(self, request: Request) -> Any:
        """Serve one embeddings request (see the module docstring)."""
        serving = self.serving
        state = request.scope.setdefault("state", {})
        ctx, arrival = await self.serving.authenticated_context(request, "embeddings")
        request_id = ctx.request_id
        engine_ids: list[str] = []
        try:
            prepared = await self._prepare(request, ctx, arrival)
            if prepared is None or ctx.replay is not None:   # the gateway answers
                if ctx.replay is None:
                    raise OpenAIError(500, "nothing to replay", code="internal_error")
                if ctx.replay.request_id:
                    state["response_request_id"] = ctx.replay.request_id
                return replay_response(ctx.replay)
            req, prompts, pooling = prepared
            ctx.request_id, engine_ids = serving.reserve_ids(request_id, len(prompts))
            await call_hook(self.gateway, "admit", ctx)
            served = ctx.served_model or ctx.model or ""
            engine = serving.engines.get(served)
            if not isinstance(engine, EmbeddingEngine):
                raise OpenAIError(500, f"the gateway chose model {served!r}, which does not "
                                  "serve embeddings", code="internal_error")
            headers = serving.response_headers(ctx, served)
        except BaseException as exc:
            await serving.refused(ctx, exc, engine_ids)
            raise
        run = GenerationRun(engine, prompts, SamplingParams(max_tokens=1), engine_ids, ctx,
                            self.metrics, RequestTimer(self.metrics, arrival), self.gateway,
                            serving.release_ids, served_model=served, pooling=pooling)
        return await self._run(request, run, req, served, headers)

    async def _prepare(self, request: Request, ctx: RequestContext, arrival: float
                       ) -> Optional[tuple[EmbeddingRequest, list[list[int]], PoolingParams]]:
        """Read, validate and tokenize; calls ``preadmit`` and ``prepare``. None when the
        gateway answers with a stored response (``ctx.replay``)."""
        serving = self.serving
        body = await serving.read_request(request, ctx, arrival)
        if len(body) > PARSE_INLINE_BYTES:   # big JSON: parse off the event loop
            req = await serving.in_thread(ctx, parse_embedding_request, body)
        else:
            req = parse_embedding_request(body)
        inputs = req.check(serving.input_limits)
        model = serving.resolve_model(req.model)
        ctx.model, ctx.user, ctx.stream, ctx.raw_body = model, req.user, False, body
        await call_hook(self.gateway, "prepare", ctx)
        if ctx.replay is not None:
            return None
        engine = serving.engines.get(ctx.served_model or model)
        if engine is None:
            raise OpenAIError(500, f"the gateway chose model {ctx.served_model!r}, which is not "
                              "served", code="internal_error")
        if not isinstance(engine, EmbeddingEngine):
            raise bad_request(f"The model `{model}` does not serve embeddings", param="model",
                              code="embeddings_not_supported")
        if req.dimensions is not None and req.dimensions > engine.embedding_size:
            raise bad_request(f"dimensions must be at most {engine.embedding_size} (the "
                              f"model's embedding size), got {req.dimensions}",
                              param="dimensions")
        prompts = await serving.in_thread(ctx, _token_ids, engine, inputs,
                                          req.truncate_prompt_tokens)
        ctx.prompt_token_ids = prompts
        ctx.prompt_tokens = sum(len(p) for p in prompts)
        ctx.longest_prompt_tokens = max(len(p) for p in prompts)
        ctx.max_tokens, ctx.num_choices = 0, len(prompts)
        if any(not p for p in prompts):
            raise bad_request("the input encodes to zero tokens", param="input")
        limit = engine.max_model_len
        if ctx.longest_prompt_tokens > limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, your input "
                f"has {ctx.longest_prompt_tokens} tokens. Please reduce the length of the "
                "input (or set truncate_prompt_tokens).",
                param="input", code="context_length_exceeded")
        pooling = PoolingParams(normalize=req.normalize is not False, dimensions=req.dimensions)
        return req, prompts, pooling

    async def _run(self, request: Request, run: GenerationRun, req: EmbeddingRequest,
                   served: str, headers: dict[str, str]) -> Any:
        """Run every input to its vector; the JSON body, or the error to send."""
        try:
            await run_until_disconnect(run.consume(), request.receive)
        except ClientDisconnected:
            await run.finish(OutcomeStatus.ABORTED)
            raise
        except BaseException as exc:
            await run.finish(OutcomeStatus.ERROR, repr(exc),
                             http_status=None if isinstance(exc, asyncio.CancelledError) else 500)
            raise
        missing = [i for i, v in enumerate(run.embeddings) if v is None]
        if missing:   # ended without a vector: a deadline, the queue timeout, an abort
            reason = run.choices[missing[0]].finish_reason or FinishReason.ABORT.value
            err = terminal_error([reason], [0]) or OpenAIError(
                500, f"input {missing[0]} ended without an embedding ({reason})",
                code="engine_error")
            self.metrics.admission.count_rejected(err.status, err.code)
            await run.finish(OutcomeStatus.ERROR, err.message,
                             CapturedResponse(err.status, dict(err.headers), body=err.body()))
            raise err
        vectors = [v for v in run.embeddings if v is not None]
        body = embeddings_body(vectors, req.encoding_format, served, run.usage().prompt_tokens)
        self.metrics.embedding_inputs.inc(len(vectors))
        await run.finish(OutcomeStatus.COMPLETED, None,
                         CapturedResponse(200, {"Content-Type": "application/json", **headers},
                                          body=body))
        return JSONResponse(body, headers=headers)


def install_embedding_routes(app: FastAPI, endpoint: EmbeddingsEndpoint) -> None:
    """Serve ``POST /v1/embeddings`` (left out of /openapi.json for now, whose schema
    fuzzing covers the generation endpoints)."""

    @app.post("/v1/embeddings", include_in_schema=False)
    async def embeddings(request: Request) -> Any:
        return await endpoint.handle(request)
