"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` (Anthropic's Messages API).

A messages request is validated and rewritten as the chat completion body that asks for
the same thing (:mod:`.request`), then served by :meth:`OpenAIServing.handle` on that
body, so it passes every gateway hook, limit and billing record a chat completion does
(the gateway sees endpoint ``chat.completions``). Its answer is rewritten back: a JSON
message (:mod:`.response`) or Anthropic's event stream (:mod:`.stream`); errors keep
their status and take Anthropic's body. ``x-api-key: KEY`` is accepted as
``Authorization: Bearer KEY`` (the gateway's keys and tenants). No torch.
"""
from __future__ import annotations

import json
import logging
from typing import Any, Optional

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response

from llmserve.contract.errors import OpenAIError
from llmserve.server.anthropic.request import (
    CountTokensRequest,
    MessagesRequest,
    chat_body,
    chat_messages,
    chat_tools,
    check_thinking,
)
from llmserve.server.anthropic.response import AnthropicError, error_from_body, message_from_chat
from llmserve.server.anthropic.stream import anthropic_events
from llmserve.server.rewrite import with_body
from llmserve.server.serving import OpenAIServing
from llmserve.server.stream.sse import ClientDisconnected, EventStreamResponse
from llmserve.server.tokenize_api import TokenizerEndpoints, chat_token_ids, parse_json_body

logger = logging.getLogger(__name__)

_DROPPED_HEADERS = ("content-length", "content-type", "x-request-id")


def _internal(exc: Exception) -> AnthropicError:
    logger.exception("unexpected error serving an Anthropic messages request", exc_info=exc)
    return AnthropicError(500, "The server had an error while processing your request")


class MessagesEndpoints:
    """The two handlers, over the server's chat request path and tokenizers."""

    def __init__(self, serving: OpenAIServing, tokenizers: TokenizerEndpoints) -> None:
        self.serving = serving
        self.tokenizers = tokenizers

    async def messages(self, request: Request) -> Response:
        """Serve one messages request (see the module docstring). The caller is
        authenticated before the body is read (a 401 before any 400), and again, as a
        chat completion, by the request path."""
        try:
            await self.tokenizers.authenticate(with_body(request, b""), "messages")
            req: MessagesRequest = parse_json_body(MessagesRequest, await self.tokenizers.read_body(request))
            reasons = self.serving.formats.reasoning_parser(self.tokenizers.resolve(req.model)) \
                is not None
            body = json.dumps(chat_body(req, reasons), ensure_ascii=False).encode("utf-8")
            response = await self.serving.handle(with_body(request, body), chat=True)
        except OpenAIError as err:
            raise AnthropicError.of(err) from None
        except ClientDisconnected:
            raise
        except Exception as exc:  # noqa: BLE001 - Anthropic's shape for the catch-all 500
            raise _internal(exc) from None
        return self._translate(response, req.model, req.stop_sequences)

    @staticmethod
    def _translate(response: Any, model: str, stop: Optional[list[str]]) -> Response:
        if isinstance(response, EventStreamResponse):
            response.events = anthropic_events(response.events, model, stop)
            return response
        if not isinstance(response, JSONResponse):
            raise AnthropicError(500, "unexpected response from the chat path")
        body = json.loads(bytes(response.body))
        headers = {k: v for k, v in response.headers.items() if k not in _DROPPED_HEADERS}
        if response.status_code == 200 and "choices" in body:
            return JSONResponse(message_from_chat(body, model, stop), headers=headers)
        return JSONResponse(error_from_body(response.status_code, body),
                            status_code=response.status_code, headers=headers)

    async def count_tokens(self, request: Request) -> dict[str, int]:
        """``{"input_tokens": n}``: the prompt tokens the same messages request would bill."""
        try:
            ctx = await self.tokenizers.authenticate(with_body(request, b""), "count_tokens")
            req: CountTokensRequest = parse_json_body(CountTokensRequest, await self.tokenizers.read_body(request))
            engine = self.tokenizers.resolve(req.model)
            check_thinking(req.thinking, self.serving.formats.reasoning_parser(engine) is not None)
            ids = await self.tokenizers.run_in_pool(
                ctx.tenant or ctx.client or "", chat_token_ids, engine.tokenizer,
                chat_messages(req), True, chat_tools(req).get("tools"),
                self.serving.formats.tool_parser(engine))
        except OpenAIError as err:
            raise AnthropicError.of(err) from None
        except Exception as exc:  # noqa: BLE001 - Anthropic's shape for the catch-all 500
            raise _internal(exc) from None
        return {"input_tokens": len(ids)}


def install_messages_routes(app: FastAPI, endpoints: MessagesEndpoints) -> None:
    """Serve ``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` (left out of
    /openapi.json, whose schema fuzzing covers the OpenAI endpoints)."""

    @app.post("/v1/messages", include_in_schema=False)
    async def messages(request: Request) -> Any:
        return await endpoints.messages(request)

    @app.post("/v1/messages/count_tokens", include_in_schema=False)
    async def count_tokens(request: Request) -> Any:
        return await endpoints.count_tokens(request)
