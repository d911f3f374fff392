"""Pure ASGI middleware (never BaseHTTPMiddleware: it hides client disconnects from streams)."""
from __future__ import annotations

import json
from typing import Any, Awaitable, Callable
from urllib.parse import quote

from server.errors import BodyTooLarge, shaped_error

ASGIApp = Callable[[dict, Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]], Awaitable[None]]


class BodySizeLimit:
    """Reject bodies over ``max_bytes``: at once from Content-Length, or while reading a chunked body."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: dict, receive: Callable[[], Awaitable[dict]],
                       send: Callable[[dict], Awaitable[None]]) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            # scope["app"]: the application (Starlette sets it before its middleware), whose error
            # shapes say how this path answers (Anthropic's on /v1/messages)
            return await _send_json(send, *shaped_error(scope.get("app"), scope.get("path", ""), 413,
                                                        f"request body exceeds {self.max_bytes} bytes",
                                                        "invalid_request_error", None, "request_too_large"))
        seen = 0

        async def limited_receive() -> dict:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        await self.app(scope, limited_receive, send)


_HEADER_SAFE = "".join(chr(c) for c in range(0x20, 0x7F) if chr(c) != "%")


def header_value(text: str) -> str:
    """``text`` as a response header value: printable ASCII kept, anything else percent-encoded
    (UTF-8). A header that echoes what a client chose (a tool's name) could otherwise hold what
    latin-1 cannot encode (a 500), a CR/LF, or a space at either end (h11 refuses the response)."""
    value = quote(text, safe=_HEADER_SAFE)
    core = value.strip(" ")
    if not core:
        return "%20" * len(value)
    start = value.index(core)
    return "%20" * start + core + "%20" * (len(value) - start - len(core))


async def _send_json(send: Callable[[dict], Awaitable[None]], status: int, body: Any) -> None:
    payload = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})
