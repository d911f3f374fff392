"""The FastAPI application: routes, auth, limits, lifecycle."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
import time
from contextlib import asynccontextmanager
from typing import AsyncIterator, Iterator

import uvicorn
from fastapi import Depends, FastAPI, Header, Request
from fastapi.responses import JSONResponse, Response

from engine.core.client import EngineClient
from server import __version__
from server.access_log import AccessLog
from server.cache_routes import add_cache_routes
from server.config import ServerConfig
from server.errors import install_error_handlers
from server.metrics import Metrics
from server.middleware import BodySizeLimit
from server.openapi import install_openapi
from server.protocol import ChatCompletionRequest, CompletionRequest
from server.push import DirectBody
from server.messages.routes import add_messages_routes
from server.responses.routes import add_responses_routes
from server.serving import OpenAIServing
from server.tokenize import DetokenizeRequest, TokenizeRequest, detokenize, tokenize

logger = logging.getLogger(__name__)


class KVServeApp(FastAPI):
    """FastAPI with the access log outside Starlette's 500 handler too, so an unhandled error's
    response carries ``X-Request-Id`` and gets its access line; outside it, ``DirectBody`` hands
    pushed streams the server's own ``send`` for their bodies (server/push.py)."""

    def build_middleware_stack(self):  # noqa: ANN201 - Starlette's ASGIApp
        return DirectBody(AccessLog(super().build_middleware_stack()))


def build_app(engine: EngineClient, config: ServerConfig, metrics: Metrics | None = None) -> FastAPI:
    """An app serving ``engine`` (built by ``kvserve.compose``). The engine starts with the app
    (a no-op if it already runs) and stops with it.

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
        engine.bind_loop(asyncio.get_running_loop())
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
            serving.close()

    app = KVServeApp(title="kvserve", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.serving = serving
    app.state.engine = engine
    install_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_bytes=config.max_body_bytes)

    def requires(right: str):  # noqa: ANN202 - a FastAPI dependency: 401 / 403, sets the request's tenant
        async def authorized(authorization: str | None = Header(default=None)) -> None:
            serving.check_api_key(authorization, right)
        return authorized

    authorized = requires("inference")

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        return await serving.chat(body, raw)

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        return await serving.completions(body, raw)

    @app.post("/tokenize", dependencies=[Depends(authorized)])
    async def tokenize_route(body: TokenizeRequest) -> dict:
        return await asyncio.to_thread(tokenize, serving, body)

    @app.post("/detokenize", dependencies=[Depends(authorized)])
    async def detokenize_route(body: DetokenizeRequest) -> dict:
        return await asyncio.to_thread(detokenize, serving, body)

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models() -> dict:
        return {"object": "list", "data": [{"id": serving.model_name, "object": "model", "created": started,
                                             "owned_by": "kvserve", "max_model_len": engine.max_model_len}]}

    @app.get("/health")
    async def health() -> Response:
        # The reason of a failure is in the log, not here: /health is public.
        if engine.is_healthy:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable"}, status_code=503)

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    add_cache_routes(app, engine, requires("cache_admin"), serving.tenancy)
    app.state.responses = add_responses_routes(app, serving, config, authorized)  # OpenAI's Responses API
    add_messages_routes(app, serving)  # Anthropic's Messages API (its own auth headers and error shape)
    if metrics is not None:
        serving.tenancy.bind_metrics(metrics.registry, serving.model_name)
        # With a key file /metrics shows every tenant's traffic: only keys with the metrics right.
        guard = [Depends(requires("metrics"))] if serving.tenancy.registry.uses_key_file else None
        app.add_api_route("/metrics", metrics.route, methods=["GET"], include_in_schema=False, dependencies=guard)
    install_openapi(app, serving)  # /openapi.json: the real statuses and bodies, no phantom 422
    return app


class DrainingServer(uvicorn.Server):
    """uvicorn with kvserve's shutdown contract.

    On SIGTERM (or SIGINT) it stops accepting connections, lets in-flight requests run for
    ``grace_s``, then aborts the rest in the engine, so their streams end with an SSE error
    frame and ``[DONE]`` (non-streamed ones get a 503), and the process exits 0. Stock uvicorn
    instead cancels the handlers mid-response (the client sees a truncated body) and re-raises
    the signal once shut down, so the process dies of SIGTERM.
    """

    def __init__(self, config: uvicorn.Config, engine: EngineClient, grace_s: float) -> None:
        super().__init__(config)
        self.engine, self.grace_s = engine, grace_s

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    async def shutdown(self, sockets=None) -> None:  # type: ignore[override]
        async def abort_after_grace() -> None:
            await asyncio.sleep(self.grace_s)
            if self.engine.num_in_flight:
                logger.warning("shutdown grace of %.1fs is over: aborting %d in-flight requests", self.grace_s,
                               self.engine.num_in_flight)
            await asyncio.to_thread(self.engine.shutdown)

        expiry = asyncio.create_task(abort_after_grace())
        try:
            await super().shutdown(sockets)
        finally:
            expiry.cancel()


def serve(app: FastAPI, engine: EngineClient, config: ServerConfig) -> bool:
    """Run ``app`` until SIGTERM/SIGINT and a drain, or until the engine client gives up
    (``engine.fatal``: the caller exits non-zero); False if the server could not start."""
    server = DrainingServer(uvicorn.Config(app, host=config.host, port=config.port, log_level="warning",
                                           # the access log is server.access_log's, one line a request;
                                           # uvicorn's other lines go to the root logger's handlers, so
                                           # they have the server's format (log_format)
                                           access_log=False, log_config=None,
                                           # a backstop only: the engine abort ends every response first
                                           timeout_graceful_shutdown=config.shutdown_grace_s + 10),
                            engine, config.shutdown_grace_s)
    app.state.serving.tenancy.install_reload_signal()  # SIGHUP re-reads the key file
    if hasattr(engine, "on_fatal"):
        # uvicorn's main loop polls should_exit; setting it from the supervisor thread is safe.
        engine.on_fatal = lambda: setattr(server, "should_exit", True)
    server.run()
    return server.started
