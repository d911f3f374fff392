"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with the right status.

Routes of another API (Anthropic's ``/v1/messages``) register their own body shape with
``add_error_shape``; every handler here then answers those paths in it, validation errors included.
"""
from __future__ import annotations

import json
import logging
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


class BodyTooLarge(StarletteHTTPException):
    """Raised by the body-size guard while a chunked body is read.

    An HTTPException subclass on purpose: FastAPI re-raises those from body parsing instead
    of turning them into a generic 400.
    """

    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, f"request body exceeds {max_bytes} bytes")


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _param_path(loc: Any) -> tuple[str | None, str | None]:
    """Pydantic's error location as an OpenAI ``param`` ("messages.0.content"), and the union
    alternative it named, if any ("list[TextPart]"): that tag is no parameter."""
    parts = []
    for p in loc:
        if p == "body" and not parts:
            continue
        if isinstance(p, str) and ("[" in p or p in _TYPE_TAGS):
            return ".".join(parts) or None, p
        parts.append(str(p))
    return ".".join(parts) or None, None


def sse_error_frame(message: str, type: str = "internal_server_error", code: str | None = None) -> str:
    return f"data: {json.dumps(error_body(message, type, None, code))}\n\n"


# (status, message, type, param, code) -> (status, body): another API's error shape
ErrorShape = Callable[[int, str, str, "str | None", "str | None"], tuple[int, dict[str, Any]]]


def add_error_shape(app: FastAPI, path_prefix: str, shape: ErrorShape) -> None:
    """Answer errors on paths starting with ``path_prefix`` in ``shape`` instead of OpenAI's."""
    if not hasattr(app.state, "error_shapes"):
        app.state.error_shapes = []
    app.state.error_shapes.append((path_prefix, shape))


def shaped_error(app: Any, path: str, status: int, message: str, type: str, param: str | None = None,
                 code: str | None = None) -> tuple[int, dict[str, Any]]:
    """(status, body) of an error on ``path``, in the shape registered for it (OpenAI's by default);
    also used by the middleware, which answers before any route or handler runs."""
    state = getattr(app, "state", None)
    for prefix, shape in getattr(state, "error_shapes", ()):
        if path.startswith(prefix):
            return shape(status, message, type, param, code)
    return status, error_body(message, type, param, code)


def _respond(request: Request, status: int, message: str, type: str, param: str | None = None,
             code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    status, body = shaped_error(request.app, request.url.path, status, message, type, param, code)
    return JSONResponse(body, status_code=status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return _respond(request, exc.status, exc.message, exc.type, exc.param, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI would answer 422 with its own shape; OpenAI answers 400 naming the parameter.
        errors = exc.errors()
        first = errors[0] if errors else {}
        param, tag = _param_path(first.get("loc", ()))
        if first.get("type") == "json_invalid":
            message, param = "the request body is not valid JSON", None
        elif first.get("type") == "missing":
            message = f"missing required parameter: '{param}'"
        elif tag is not None:  # a union field: pydantic reports one error per alternative
            alternatives = dict.fromkeys(t for t in (_param_path(e.get("loc", ()))[1] for e in errors
                                                     if _param_path(e.get("loc", ()))[0] == param) if t)
            message = f"invalid value for '{param}': expected one of {', '.join(alternatives)}"
        else:
            message = f"invalid value for '{param}': {first.get('msg', 'invalid')}" if param else \
                str(first.get("msg", "invalid request"))
        return _respond(request, 400, message, "invalid_request_error", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        code = "request_too_large" if exc.status_code == 413 else None
        return _respond(request, exc.status_code, str(exc.detail), type_, None, code, getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return _respond(request, 500, f"internal error: {type(exc).__name__}", "internal_server_error")
