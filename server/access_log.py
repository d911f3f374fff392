"""The access log: one line per HTTP request, and the request id that ties a request's lines together.

Contract:

* ``AccessLog`` is a pure ASGI middleware, the outermost layer of the app (outside Starlette's
  500 handler, see ``server.app``), so it sees every response: each route, 401/404/413/429,
  unhandled errors and streams.
* Request id: the client's ``X-Request-Id`` when it is 1-128 characters of ``[A-Za-z0-9._:-]``
  (anything else is replaced, not echoed), otherwise a new uuid4 hex. Every response carries it
  back in ``X-Request-Id``.
* The engine runs the request's choices under ``engine_request_id(prefix)``-``i``, which holds
  the request id: ``chatcmpl-<id>`` when the server made the id (unique by construction), or
  ``chatcmpl-<client id>.<12 hex>`` (a client may reuse its ids; the engine may not). The engine's
  log lines name that id, so one grep for the request id finds them; it is also the response's
  ``id`` on the OpenAI routes. Log lines of the server process written while it serves the
  request carry ``request_id`` (``RequestIdFilter``).
* Exactly one line per request on the ``kvserve.access`` logger (INFO), written when the
  response ends: after its last body byte (a stream's last SSE frame), when the client has gone,
  or when the app raised. Fields, ``-`` (JSON: null) when unknown or not applicable:
  ``request_id tenant method route status prompt_tokens cached_tokens generated_tokens ttft_ms
  duration_ms finish_reason engine_id``. ``tenant`` is the authenticated tenant's name
  (``anonymous`` without a key file), ``-`` where authentication failed or the route has none.
  ``route`` is the path without the query string, percent-escaped, at most 256 characters. The
  token counts equal the response's ``usage``; ``finish_reason`` is the engine's per choice
  (``stop``, ``length``; ``cancelled`` when the client left first, ``error`` / ``abort`` when
  the engine failed or shut down), distinct values joined by ``,``; ``ttft_ms`` is from the
  request's arrival to the first generated token reaching the server.
* Never logged: prompt or output text, query strings, headers, keys, digests or salts.

The code serving a request fills its ``AccessRecord`` through ``current_record()`` (a context
variable, so a stream's body task and worker threads started with ``asyncio.to_thread`` see the
same record).
"""
from __future__ import annotations

import logging
import re
import time
import uuid
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Sequence
from urllib.parse import quote

from engine.log_format import TEXT_FORMAT, JsonFormatter, check_log_format, format_root_handlers

logger = logging.getLogger("kvserve.access")

HEADER = b"x-request-id"
_VALID_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
MAX_ROUTE_CHARS = 256
FIELDS = ("request_id", "tenant", "method", "route", "status", "prompt_tokens", "cached_tokens", "generated_tokens",
          "ttft_ms", "duration_ms", "finish_reason", "engine_id")

ASGIApp = Callable[[dict, Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]], Awaitable[None]]


@dataclass
class AccessRecord:
    """What the access line of one request says; filled while the request is served."""

    request_id: str
    id_generated: bool  # the server made ``request_id`` (then it is unique)
    method: str
    route: str
    started: float = field(default_factory=time.monotonic)
    tenant: str = "-"
    status: int | None = None
    engine_id: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    generated_tokens: int | None = None
    finish_reasons: list[str] = field(default_factory=list)
    first_token_at: float | None = None

    def engine_ran(self, prompt_tokens: int, cached_tokens: int, generated_tokens: int,
                   finish_reasons: Sequence[str]) -> None:
        """The request's engine run ended with these counts (its ``usage``) and reasons, one per choice."""
        self.prompt_tokens = (self.prompt_tokens or 0) + prompt_tokens
        self.cached_tokens = (self.cached_tokens or 0) + cached_tokens
        self.generated_tokens = (self.generated_tokens or 0) + generated_tokens
        self.finish_reasons.extend(finish_reasons)

    def first_token(self) -> None:
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()

    def fields(self, now: float) -> dict[str, Any]:
        ttft = None if self.first_token_at is None else round((self.first_token_at - self.started) * 1000, 1)
        return {"request_id": self.request_id, "tenant": self.tenant, "method": self.method, "route": self.route,
                "status": self.status, "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "generated_tokens": self.generated_tokens, "ttft_ms": ttft,
                "duration_ms": round((now - self.started) * 1000, 1),
                "finish_reason": ",".join(dict.fromkeys(self.finish_reasons)) or None, "engine_id": self.engine_id}

    def write(self) -> None:
        values = self.fields(time.monotonic())
        # every value is a number or of a safe character set (ids validated, tenant names
        # [A-Za-z0-9_.-], the route percent-escaped): no quoting needed
        line = " ".join(f"{k}={'-' if v is None else v}" for k, v in values.items())
        logger.info("%s", line, extra={"fields": values,
                                       "json_message": f"{self.method} {self.route} {self.status or '-'}"})


_RECORD: ContextVar[AccessRecord | None] = ContextVar("kvserve_access_record", default=None)


def current_record() -> AccessRecord | None:
    """The record of the request being served here; None outside a request (unit tests, the engine)."""
    return _RECORD.get()


def note_tenant(name: str) -> None:
    record = _RECORD.get()
    if record is not None:
        record.tenant = name


def engine_request_id(prefix: str) -> str:
    """The id the engine runs this request under (see the module doc); a uuid one outside a request."""
    record = _RECORD.get()
    if record is None:
        return f"{prefix}-{uuid.uuid4().hex}"
    unique = record.id_generated and record.engine_id is None
    engine_id = f"{prefix}-{record.request_id}" if unique else f"{prefix}-{record.request_id}.{uuid.uuid4().hex[:12]}"
    record.engine_id = engine_id
    return engine_id


def request_id_from(headers: Sequence[tuple[bytes, bytes]]) -> tuple[str, bool]:
    """(the request id, whether the server generated it) from the request's headers."""
    for name, value in headers:
        if name.lower() == HEADER:
            try:
                given = value.decode("ascii")
            except UnicodeDecodeError:
                break
            if _VALID_ID.fullmatch(given):
                return given, False
            break  # the first one decides: an invalid id is replaced, not echoed
    return uuid.uuid4().hex, True


def route_of(scope: dict) -> str:
    path = quote(scope.get("path") or "/", safe="/-._~:@!$&'()*+,;=")
    return path if len(path) <= MAX_ROUTE_CHARS else path[:MAX_ROUTE_CHARS - 3] + "..."


class AccessLog:
    """The middleware (see the module doc)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Callable[[], Awaitable[dict]],
                       send: Callable[[dict], Awaitable[None]]) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request_id, generated = request_id_from(scope.get("headers") or [])
        record = AccessRecord(request_id, generated, str(scope.get("method", "-")), route_of(scope))
        header = (HEADER, request_id.encode("ascii"))

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
                headers = [h for h in message.get("headers") or [] if bytes(h[0]).lower() != HEADER]
                message = {**message, "headers": [*headers, header]}
            await send(message)

        token = _RECORD.set(record)
        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            if record.status is None:  # Starlette's handler sends the 500 before re-raising; this is a backstop
                record.status = 500
            raise
        finally:
            _RECORD.reset(token)
            record.write()


class RequestIdFilter(logging.Filter):
    """Sets ``request_id`` on records written while a request is served (None elsewhere)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            current = _RECORD.get()
            record.request_id = current.request_id if current is not None else None
        return True


class TextFormatter(logging.Formatter):
    """``TEXT_FORMAT``, plus `` request_id=ID`` on a line written while a request is served
    (the access line names it already)."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def formatMessage(self, record: logging.LogRecord) -> str:  # before any traceback
        text = super().formatMessage(record)
        request_id = getattr(record, "request_id", None)
        if request_id is not None and getattr(record, "fields", None) is None:
            text += f" request_id={request_id}"
        return text


_FILTER = RequestIdFilter()


def use_log_format(log_format: str) -> None:
    """Format every line of the root logger's handlers as ``log_format`` (``text`` or ``json``)."""
    check_log_format(log_format)
    format_root_handlers(JsonFormatter() if log_format == "json" else TextFormatter(), _FILTER)
