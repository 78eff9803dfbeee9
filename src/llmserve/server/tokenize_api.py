"""``POST /tokenize`` and ``POST /detokenize``: a model's tokenizer over HTTP (vLLM's bodies).

Clients count and budget tokens with them before they send a request::

    /tokenize    {"model"?, "prompt": "text", "add_special_tokens"?: true}
                 {"model"?, "messages": [...], "add_generation_prompt"?: true, "tools"?}
              -> {"count": n, "max_model_len": L, "tokens": [ids], "token_strs": [..] | null}
    /detokenize  {"model"?, "tokens": [ids]}  ->  {"prompt": "text"}

A chat body is tokenized exactly as ``/v1/chat/completions`` builds its prompt (the same
template, the same tool preamble), so ``count`` is what that request's ``prompt_tokens``
will be. Both endpoints call the gateway's ``authenticate`` only (like ``/v1/models``: no
rate limit, no billing, no engine work); bodies are capped by the server's
``max_body_bytes`` and tokenized on the request threads shared fairly by tenant. A model
name may be a served model, a LoRA adapter or a gateway release (its current target's
tokenizer). No torch.
"""
from __future__ import annotations

import json
import time
from typing import Any, Callable, Optional, Union

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from llmserve.contract.engine_client import EngineClient, TokenizerLike
from llmserve.contract.errors import OpenAIError, bad_request
from llmserve.contract.gateway_hook import RequestContext, call_hook
from llmserve.server.errors import validation_error_to_openai
from llmserve.server.limits import check_token_ids
from llmserve.server.protocol.openai import ChatMessage
from llmserve.server.protocol.tool_calls import check_tools
from llmserve.server.serving import OpenAIServing, read_body
from llmserve.tokenizer.chat_prompt import chat_prompt_tokens
from llmserve.tool_parsers import ToolParser

_CLOSED = ConfigDict(extra="forbid")


class TokenizeTextRequest(BaseModel):
    """Tokenize text, as ``/v1/completions`` does a text prompt."""

    model_config = _CLOSED
    model: Optional[str] = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(BaseModel):
    """Tokenize chat messages, as ``/v1/chat/completions`` builds its prompt."""

    model_config = _CLOSED
    model: Optional[str] = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    add_generation_prompt: bool = True
    tools: Optional[list[Any]] = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = _CLOSED
    model: Optional[str] = None
    tokens: list[int]


def json_object(body: bytes) -> dict[str, Any]:
    """``body`` as a JSON object; a 400 (OpenAI shape) otherwise."""
    try:
        data = json.loads(body.decode("utf-8")) if body.strip() else None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise bad_request(f"The request body is not valid JSON: {exc}", code="invalid_json") \
            from None
    if not isinstance(data, dict):
        raise bad_request("The request body must be a JSON object", code="invalid_json")
    return data


def validated(model_cls: type[BaseModel], data: dict[str, Any]) -> Any:
    """``data`` as a ``model_cls``; a 400 (OpenAI shape) naming the field otherwise."""
    try:
        return model_cls.model_validate(data)
    except ValidationError as exc:
        raise validation_error_to_openai(exc.errors(include_url=False), {}) from None


def parse_json_body(model_cls: type[BaseModel], body: bytes) -> Any:
    """``body`` as a ``model_cls`` (:func:`json_object`, then :func:`validated`)."""
    return validated(model_cls, json_object(body))


class TokenizerEndpoints:
    """The two handlers, over the server's engines, body cap and tokenizer threads."""

    def __init__(self, serving: OpenAIServing,
                 public_targets: Callable[[], dict[str, str]]) -> None:
        """``public_targets()``: the gateway's public names (releases) -> served model."""
        self.serving = serving
        self.public_targets = public_targets
        self.gateway = serving.gateway

    def resolve(self, requested: Optional[str]) -> EngineClient:
        """The engine whose tokenizer serves ``requested`` (404 when no model has it)."""
        name = self.serving.resolve_model(requested)
        engine = self.serving.engines.get(name)
        if engine is None:
            engine = self.serving.engines.get(self.public_targets().get(name, ""))
        if engine is None:
            raise OpenAIError(404, f"The model `{name}` is not served now", param="model",
                              code="model_not_found")
        return engine

    async def read_body(self, request: Request) -> bytes:
        limits = self.serving.limits
        return await read_body(request, limits.max_body_bytes, limits.body_read_timeout_s)

    async def run_in_pool(self, key: str, fn: Callable[..., Any], *args: Any) -> Any:
        return await self.serving.tokenizer_pool.run(key, fn, *args)

    async def authenticate(self, request: Request, endpoint: str) -> RequestContext:
        """The gateway's ``authenticate`` for this request (401/403 raise)."""
        state = request.scope.get("state", {})
        ctx = RequestContext(
            request_id=state.get("request_id", ""), endpoint=endpoint,
            headers={k.lower(): v for k, v in request.headers.items()},
            client=request.client.host if request.client else None,
            arrival_time=state.get("arrival_time", time.time()))
        await call_hook(self.gateway, "authenticate", ctx)
        return ctx

    async def tokenize(self, request: Request) -> dict[str, Any]:
        ctx = await self.authenticate(request, "tokenize")
        data = json_object(await self.read_body(request))
        req: Union[TokenizeTextRequest, TokenizeChatRequest] = validated(
            TokenizeChatRequest if "messages" in data else TokenizeTextRequest, data)
        engine = self.resolve(req.model)
        tok = engine.tokenizer
        key = ctx.tenant or ctx.client or ""
        if isinstance(req, TokenizeChatRequest):
            ids = await self.run_in_pool(key, chat_token_ids, tok, req.messages,
                                         req.add_generation_prompt, req.tools,
                                         self.serving.formats.tool_parser(engine))
        else:
            ids = await self.run_in_pool(key, _text_ids, tok, req.prompt,
                                         req.add_special_tokens)
        strs = await self.run_in_pool(key, _pieces, tok, ids) if req.return_token_strs \
            else None
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids,
                "token_strs": strs}

    async def detokenize(self, request: Request) -> dict[str, Any]:
        ctx = await self.authenticate(request, "detokenize")
        req: DetokenizeRequest = parse_json_body(DetokenizeRequest,
                                                 await self.read_body(request))
        engine = self.resolve(req.model)
        tok = engine.tokenizer
        check_token_ids(tok, req.tokens, "tokens", "tokens")
        text = await self.run_in_pool(ctx.tenant or ctx.client or "", tok.decode, req.tokens,
                                      False)
        return {"prompt": text}


def _text_ids(tok: TokenizerLike, text: str, add_special_tokens: bool) -> list[int]:
    return list(tok.encode(text, add_special_tokens=add_special_tokens))


def _pieces(tok: TokenizerLike, ids: list[int]) -> list[str]:
    return [tok.decode([t], skip_special_tokens=False) for t in ids]


def chat_token_ids(tok: TokenizerLike, messages: list[dict[str, Any]], add_generation_prompt: bool,
                   tools: Optional[list[Any]], parser: Optional[ToolParser] = None) -> list[int]:
    """The prompt ``/v1/chat/completions`` builds for these messages and tools (the same
    validation, template and tool preamble); 400 for what that request would refuse."""
    checked = []
    for i, raw in enumerate(messages):
        try:
            msg = ChatMessage.model_validate(raw)
        except ValidationError as exc:
            errors = [dict(e, loc=("messages", i, *e["loc"])) for e in exc.errors(include_url=False)]
            raise validation_error_to_openai(errors, {}) from None
        checked.append(msg.to_template_dict(i))
    try:
        return list(chat_prompt_tokens(tok, checked, add_generation_prompt, check_tools(tools),
                                       parser))
    except ValueError as exc:   # as /v1/chat/completions answers it
        raise bad_request(f"Invalid messages: {exc}", param="messages") from None


def install_tokenizer_routes(app: FastAPI, endpoints: TokenizerEndpoints) -> None:
    """Serve ``POST /tokenize`` and ``POST /detokenize`` (left out of /openapi.json, whose
    schema fuzzing covers the OpenAI endpoints)."""

    @app.post("/tokenize", include_in_schema=False)
    async def tokenize(request: Request) -> Any:
        return await endpoints.tokenize(request)

    @app.post("/detokenize", include_in_schema=False)
    async def detokenize(request: Request) -> Any:
        return await endpoints.detokenize(request)

