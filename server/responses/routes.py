"""The Responses API's routes, added to the app behind its API-key dependency."""
from __future__ import annotations

from typing import Any, Callable

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response

from server.config import ServerConfig
from server.responses.protocol import ResponsesRequest
from server.responses.serving import ResponsesServing
from server.responses.store import ResponseStore
from server.serving import OpenAIServing


def add_responses_routes(app: FastAPI, serving: OpenAIServing, config: ServerConfig,
                         authorized: Callable[..., Any]) -> ResponsesServing:
    responses = ResponsesServing(serving, ResponseStore(config.response_store))

    @app.post("/v1/responses", dependencies=[Depends(authorized)])
    async def create_response(body: ResponsesRequest, raw: Request) -> Response:
        return await responses.create(body, raw)

    @app.get("/v1/responses/{response_id}", dependencies=[Depends(authorized)])
    async def retrieve_response(response_id: str) -> dict:
        return responses.retrieve(response_id)

    @app.delete("/v1/responses/{response_id}", dependencies=[Depends(authorized)])
    async def delete_response(response_id: str) -> dict:
        return responses.delete(response_id)

    return responses
