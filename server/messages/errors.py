"""Anthropic's error shape: ``{"type": "error", "error": {"type", "message"}}``.

The status stays kvserve's (400, 401, 404, 413, 429, 500, 503); the type is the one Anthropic
gives that status. Anthropic's body has no ``param``: the message names the field.
"""
from __future__ import annotations

import json
from typing import Any

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
          503: "overloaded_error", 529: "overloaded_error"}


def error_type(status: int) -> str:
    return _TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def anthropic_error(status: int, message: str, type: str = "", param: str | None = None,
                    code: str | None = None) -> tuple[int, dict[str, Any]]:
    """An ``ErrorShape`` (server.errors.add_error_shape): kvserve's error as Anthropic's body
    (its message prefixed with the parameter, as Anthropic's are, unless it names it already)."""
    if param and param not in message:
        message = f"{param}: {message}"
    return status, {"type": "error", "error": {"type": error_type(status), "message": message}}


def sse_error_event(status: int, message: str) -> str:
    """The ``error`` event that ends a stream the engine failed."""
    _, body = anthropic_error(status, message)
    return f"event: error\ndata: {json.dumps(body)}\n\n"
