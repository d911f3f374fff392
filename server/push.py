"""Streamed responses whose frames are written where the engine's outputs arrive.

A ``StreamingResponse`` pulls each frame through a chain of async generators, one task wake-up
per frame: the engine client's stream, the run's outputs, the endpoint's frames, Starlette's
response loop. Here the engine hands each output to a sink (``EngineClient.push``) in the event
loop's read of the core's pipe, the sink makes the frames and ``FrameWriter`` gives them to the
ASGI ``send`` at once, with no task, queue or generator between.

Contract:

- ``FrameWriter.write`` runs ``send`` to its end inside the call when ``send`` completes without
  waiting, which uvicorn's does unless its flow control paused writing (the client reads slower
  than the server writes). A ``send`` that waits is finished by a task, and frames written
  meanwhile go out after it, in order. So the bytes on the wire are the ones a
  ``StreamingResponse`` of the same frames would send.
- ``FrameWriter.end`` ends the body (after the frames written before it; ``ended`` at once) and
  ``done`` resolves once it is sent. ``fail`` resolves it with an
  error (a sink's bug, or a ``send`` that raised). Frames written after either are dropped.
- ``PushedSSE(open_run)``: after the response's headers, ``open_run(writer)`` starts the run and
  returns ``close``; the response calls ``close()`` exactly once, when ``done`` resolved or the
  client left (``http.disconnect``), and returns. ``close`` must abort whatever still runs.
- The headers go through every middleware's ``send``; the body goes to the server's own
  ``send``, which ``DirectBody``, the app's outermost layer, leaves in the scope (``BODY_SEND``;
  without it, the ``send`` the response was given). A body message through the middleware
  would pass four wrappers a chunk that only look at the start (the access log's, Starlette's
  error and exception handlers'), so no middleware of this app may change a response's body.
"""
from __future__ import annotations

import asyncio
import collections
from typing import Any, Awaitable, Callable, Coroutine

from starlette.responses import Response

Send = Callable[[dict], Awaitable[None]]
ASGIApp = Callable[[dict, Callable[[], Awaitable[dict]], Send], Awaitable[None]]

BODY_SEND = "kvserve.body_send"  # the scope key of the server's own send (DirectBody)


class DirectBody:
    """Pure ASGI middleware, the app's outermost layer: leaves the server's ``send`` in the
    scope under ``BODY_SEND``, for pushed responses' bodies (see the module doc)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Callable[[], Awaitable[dict]], send: Send) -> None:
        if scope["type"] == "http":
            scope[BODY_SEND] = send
        await self.app(scope, receive, send)


class FrameWriter:
    """The frames of one response, through ``send`` in order (see the module doc)."""

    def __init__(self, send: Send, loop: asyncio.AbstractEventLoop) -> None:
        self._send = send
        self.done: asyncio.Future = loop.create_future()
        self._backlog: collections.deque[dict] = collections.deque()
        self._waiting: asyncio.Task | None = None  # the task finishing a send that waits
        self.ended = False  # end(), fail() or abandon() was called: nothing more is written

    def write(self, frame: str) -> None:
        self._put({"type": "http.response.body", "body": frame.encode(), "more_body": True})

    def end(self) -> None:
        """The response ends (an empty last body, as ``StreamingResponse`` ends)."""
        self._put({"type": "http.response.body", "body": b"", "more_body": False})
        self.ended = True

    def fail(self, exc: BaseException) -> None:
        self.ended = True
        if not self.done.done():
            self.done.set_exception(exc)

    def abandon(self) -> None:
        """The response is over (the client left): drop queued frames and stop a waiting send."""
        self.ended = True
        self._backlog.clear()
        if self._waiting is not None:
            self._waiting.cancel()
        if not self.done.done():
            self.done.cancel()

    def _put(self, message: dict) -> None:
        if self.ended:
            return
        if self._waiting is not None:
            self._backlog.append(message)
        else:
            self._start(message)

    def _start(self, message: dict) -> None:
        """Run ``send(message)`` as far as it goes without waiting."""
        coro = self._send(message)
        try:
            awaited = coro.send(None)
        except StopIteration:
            self._sent(message)
            return
        except BaseException as exc:  # noqa: BLE001 - the response re-raises it
            self.fail(exc)
            return
        self._waiting = asyncio.ensure_future(self._finish(coro, awaited, message))

    async def _finish(self, coro: Coroutine[Any, Any, None], awaited: Any, message: dict) -> None:
        """Drive a ``send`` that waits (on ``awaited``: a future, or None for a bare yield) to its
        end, as a task would, then the frames that queued behind it."""
        try:
            while True:
                if awaited is None:
                    await asyncio.sleep(0)
                else:  # a future the send yielded: take it over as a task would (the flag marks it taken)
                    awaited._asyncio_future_blocking = False
                    await awaited
                try:
                    awaited = coro.send(None)
                except StopIteration:
                    break
        except BaseException as exc:  # noqa: BLE001 - the send raised, or this task was cancelled
            coro.close()
            self.fail(exc)
            return
        self._waiting = None
        self._sent(message)
        while self._backlog and self._waiting is None and not self.done.done():
            self._start(self._backlog.popleft())

    def _sent(self, message: dict) -> None:
        if not message["more_body"] and not self.done.done():
            self.done.set_result(None)


class PushedSSE(Response):
    """A ``text/event-stream`` response whose frames its run writes (see the module doc)."""

    media_type = "text/event-stream"

    def __init__(self, open_run: Callable[[FrameWriter], Callable[[], None]],
                 headers: dict[str, str] | None = None) -> None:
        # as StreamingResponse: no body attribute, so no content-length (the body goes chunked)
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})
        self._open_run = open_run

    async def __call__(self, scope: dict, receive: Callable[[], Awaitable[dict]], send: Send) -> None:
        writer = FrameWriter(scope.get(BODY_SEND, send), asyncio.get_running_loop())
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})

        async def client_gone() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        watcher = asyncio.ensure_future(client_gone())
        try:
            close = self._open_run(writer)
            try:
                await asyncio.wait({writer.done, watcher}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                close()
        finally:
            watcher.cancel()
            writer.abandon()
        if writer.done.done() and not writer.done.cancelled() and writer.done.exception() is not None:
            exc = writer.done.exception()
            if not isinstance(exc, OSError):  # a socket that closed under a send is a client that left
                raise exc
