"""``/v1/responses``: create (streamed or not), retrieve, delete, list input items.

A create request is validated and rewritten as the chat completion body that asks for the
same thing (:mod:`.request`), after the conversation its ``previous_response_id`` names,
then served by :meth:`OpenAIServing.handle` on that body: it passes every gateway hook,
limit, idempotency check and billing record a chat completion does (the gateway sees
endpoint ``chat.completions``). The answer is rewritten back: a response object
(:mod:`.output`) or the Responses event stream (:mod:`.stream`); errors keep OpenAI's
shape and status. With ``store`` (the default) the response is kept in the
:class:`~.store.ResponseStore` under the caller's tenant. The read endpoints
authenticate (the gateway's keys and tenants) and see only the caller's tenant's
responses. No torch.
"""
from __future__ import annotations

import json
import time
from typing import Any, Optional

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response

from llmserve.contract.errors import OpenAIError, bad_request
from llmserve.server.responses_api.output import (
    ResponseShell,
    body_digest,
    conversation_of,
    item_id,
    response_from_chat,
    response_id,
)
from llmserve.server.responses_api.request import ResponsesRequest, chat_body, input_messages
from llmserve.server.responses_api.store import ResponseStore, StoredResponse
from llmserve.server.responses_api.stream import ResponseStreamTranslator, response_events
from llmserve.server.rewrite import with_body
from llmserve.server.serving import OpenAIServing
from llmserve.server.stream.sse import EventStreamResponse
from llmserve.server.tokenize_api import TokenizerEndpoints, parse_json_body

_DROPPED_HEADERS = ("content-length", "content-type", "x-request-id")
_ITEM_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
                "reasoning": "rs"}


def input_item_records(raw: Any, resp_id: str) -> list[dict[str, Any]]:
    """A request's ``input`` as the items ``GET .../input_items`` lists (ids filled in)."""
    items = [{"type": "message", "role": "user",
              "content": [{"type": "input_text", "text": raw}]}] if isinstance(raw, str) \
        else [dict(item) for item in raw]
    for i, item in enumerate(items):
        kind = item.setdefault("type", "message")
        if not item.get("id"):
            item["id"] = item_id(_ITEM_PREFIX.get(kind, "item") + "_in", resp_id, i)
        if kind == "message" and isinstance(item.get("content"), str):
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            item["content"] = [{"type": part, "text": item["content"]}]
    return items


def not_found(resp_id: str, param: str = "response_id") -> OpenAIError:
    return OpenAIError(404, f"Response with id '{resp_id}' not found.", param=param,
                       code="not_found")


class ResponsesEndpoints:
    """The handlers, over the server's chat request path, tokenizers and store."""

    def __init__(self, serving: OpenAIServing, tokenizers: TokenizerEndpoints,
                 store: ResponseStore) -> None:
        self.serving = serving
        self.tokenizers = tokenizers
        self.store = store

    async def _tenant(self, request: Request, endpoint: str) -> str:
        ctx = await self.tokenizers.authenticate(with_body(request, b""), endpoint)
        return ctx.tenant or ""

    async def create(self, request: Request) -> Response:
        """Serve one create request (see the module docstring). The caller is
        authenticated before the body is read (a 401 before any 400), and again, as a
        chat completion, by the request path."""
        tenant = await self._tenant(request, "responses")
        raw = await self.tokenizers.read_body(request)
        req: ResponsesRequest = parse_json_body(ResponsesRequest, raw)
        req.check()
        history: list[dict[str, Any]] = []
        if req.previous_response_id:
            previous = await self.store.aget(tenant, req.previous_response_id)
            if previous is None:
                raise not_found(req.previous_response_id, "previous_response_id")
            history = previous.conversation
        new_messages = input_messages(req.input)
        reasons = self.serving.formats.reasoning_parser(self.tokenizers.resolve(req.model)) is not None
        body = json.dumps(chat_body(req, history, new_messages, reasons), ensure_ascii=False)
        response = await self.serving.handle(with_body(request, body.encode("utf-8")),
                                             chat=True)
        digest = body_digest(raw)

        def make_shell(chat_id: str, created: Any, model: str) -> ResponseShell:
            return ResponseShell(response_id(tenant, chat_id, created, digest),
                                 int(created or time.time()), model or (req.model or ""), req)

        async def keep(final: dict[str, Any]) -> None:
            if req.store:
                await self.store.aput(tenant, StoredResponse(
                    final, input_item_records(req.input, final["id"]),
                    history + new_messages + conversation_of(final["output"])))

        if isinstance(response, EventStreamResponse):
            response.events = response_events(response.events,
                                              ResponseStreamTranslator(make_shell), keep)
            return response
        if not isinstance(response, JSONResponse):
            raise OpenAIError(500, "unexpected response from the chat path",
                              code="internal_error")
        chat = json.loads(bytes(response.body))
        headers = {k: v for k, v in response.headers.items() if k not in _DROPPED_HEADERS}
        if response.status_code != 200 or "choices" not in chat:
            return JSONResponse(chat, status_code=response.status_code, headers=headers)
        final = response_from_chat(chat, make_shell(chat.get("id", ""), chat.get("created"),
                                                    chat.get("model", "")))
        await keep(final)
        return JSONResponse(final, headers=headers)

    async def retrieve(self, request: Request, resp_id: str) -> dict[str, Any]:
        """``GET /v1/responses/{id}``: the stored response (404 when absent)."""
        if request.query_params.get("stream") in ("true", "1"):
            raise bad_request("streaming a stored response is not supported", param="stream")
        stored = await self.store.aget(await self._tenant(request, "responses"), resp_id)
        if stored is None:
            raise not_found(resp_id)
        return stored.response

    async def delete(self, request: Request, resp_id: str) -> dict[str, Any]:
        """``DELETE /v1/responses/{id}``."""
        if not await self.store.adelete(await self._tenant(request, "responses"), resp_id):
            raise not_found(resp_id)
        return {"id": resp_id, "object": "response", "deleted": True}

    async def input_items(self, request: Request, resp_id: str) -> dict[str, Any]:
        """``GET /v1/responses/{id}/input_items`` (``limit`` 1-100, default 20;
        ``order`` asc | desc, default desc; ``after`` an item id)."""
        query = request.query_params
        limit = _int_param(query.get("limit"), "limit", 20)
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise bad_request("order must be 'asc' or 'desc'", param="order")
        stored = await self.store.aget(await self._tenant(request, "responses"), resp_id)
        if stored is None:
            raise not_found(resp_id)
        items = stored.input_items if order == "asc" else stored.input_items[::-1]
        after = query.get("after")
        if after is not None:
            ids = [item.get("id") for item in items]
            if after not in ids:
                raise bad_request(f"no input item {after!r} in this response", param="after")
            items = items[ids.index(after) + 1:]
        page = items[:limit]
        return {"object": "list", "data": page,
                "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None,
                "has_more": len(items) > len(page)}


def _int_param(value: Optional[str], name: str, default: int) -> int:
    if value is None:
        return default
    if not value.isdigit() or not 1 <= int(value) <= 100:
        raise bad_request(f"{name} must be an integer from 1 to 100", param=name)
    return int(value)


def install_responses_routes(app: FastAPI, endpoints: ResponsesEndpoints) -> None:
    """Serve the Responses endpoints (left out of /openapi.json, whose schema fuzzing
    covers the chat and completions endpoints)."""

    @app.post("/v1/responses", include_in_schema=False)
    async def create(request: Request) -> Any:
        return await endpoints.create(request)

    @app.get("/v1/responses/{resp_id}", include_in_schema=False)
    async def retrieve(request: Request, resp_id: str) -> Any:
        return await endpoints.retrieve(request, resp_id)

    @app.delete("/v1/responses/{resp_id}", include_in_schema=False)
    async def delete(request: Request, resp_id: str) -> Any:
        return await endpoints.delete(request, resp_id)

    @app.get("/v1/responses/{resp_id}/input_items", include_in_schema=False)
    async def input_items(request: Request, resp_id: str) -> Any:
        return await endpoints.input_items(request, resp_id)
