"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``, their auth and their error shape.

Auth takes the server's API key as ``x-api-key: KEY`` (Anthropic's header) or
``Authorization: Bearer KEY`` (compared in constant time by ``OpenAIServing.check_api_key``).
``anthropic-version`` and ``anthropic-beta`` headers and the ``?beta=true`` query that Claude
Code sends are accepted, whatever their value.
"""
from __future__ import annotations

from fastapi import Depends, FastAPI, Header, Request
from fastapi.responses import Response

from server.errors import APIError, add_error_shape
from server.messages.errors import anthropic_error
from server.messages.protocol import CountTokensRequest, MessagesRequest
from server.messages.serving import MessagesServing
from server.serving import OpenAIServing

PATH = "/v1/messages"


def add_messages_routes(app: FastAPI, serving: OpenAIServing) -> None:
    messages = MessagesServing(serving)
    add_error_shape(app, PATH, anthropic_error)

    async def authorized(x_api_key: str | None = Header(default=None),
                         authorization: str | None = Header(default=None)) -> None:
        try:
            serving.check_api_key(f"Bearer {x_api_key}" if x_api_key is not None else authorization)
        except APIError as exc:
            if exc.status != 401:
                raise
            raise APIError(401, "invalid or missing API key: pass it as 'x-api-key: <key>' or "
                           "'Authorization: Bearer <key>'", exc.type, None, exc.code) from None

    @app.post(PATH, dependencies=[Depends(authorized)])
    async def create_message(body: MessagesRequest, raw: Request) -> Response:
        return await messages.create(body, raw)

    @app.post(f"{PATH}/count_tokens", dependencies=[Depends(authorized)])
    async def count_tokens(body: CountTokensRequest) -> dict:
        return await messages.count_tokens(body)
