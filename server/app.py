"""The FastAPI application: routes, auth, limits, lifecycle."""
from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager
from typing import AsyncIterator

from fastapi import Depends, FastAPI, Header, Request
from fastapi.responses import JSONResponse, Response

from engine.async_engine import AsyncEngine
from server import __version__
from server.config import ServerConfig
from server.errors import install_error_handlers
from server.metrics import Metrics
from server.middleware import BodySizeLimit
from server.protocol import ChatCompletionRequest, CompletionRequest
from server.serving import OpenAIServing


def build_app(engine: AsyncEngine, config: ServerConfig, metrics: Metrics | None = None) -> FastAPI:
    """An app serving ``engine``. The engine loop starts with the app and stops with it.

    ``metrics`` should be the engine's observer; it adds ``/metrics`` and the periodic stats line.
    """
    serving = OpenAIServing(engine, config)
    started = int(time.time())

    async def log_stats_forever() -> None:
        while True:
            await asyncio.sleep(config.log_stats_interval_s)
            metrics.log_stats()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        stats_task = None
        if metrics is not None and config.log_stats_interval_s > 0:
            stats_task = asyncio.create_task(log_stats_forever())
        try:
            yield
        finally:
            if stats_task is not None:
                stats_task.cancel()
            # Off the event loop: joining the engine thread may take a step's time.
            await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="kvserve", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.serving = serving
    app.state.engine = engine
    install_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_bytes=config.max_body_bytes)

    async def authorized(authorization: str | None = Header(default=None)) -> None:
        serving.check_api_key(authorization)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        return await serving.chat(body, raw)

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        return await serving.completions(body, raw)

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models() -> dict:
        return {"object": "list", "data": [{"id": serving.model_name, "object": "model", "created": started,
                                             "owned_by": "kvserve", "max_model_len": engine.max_model_len}]}

    @app.get("/health")
    async def health() -> Response:
        if engine.is_healthy:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unhealthy", "error": str(engine.error or "engine stopped")}, status_code=503)

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    if metrics is not None:
        app.add_api_route("/metrics", metrics.route, methods=["GET"], include_in_schema=False)
    return app
