"""Log line formats shared by the server process and the engine core process.

``text`` (the default) is ``TEXT_FORMAT``; ``json`` writes one JSON object a line for log
shippers: ``ts`` (UTC, ISO 8601, ms), ``level``, ``logger``, ``message``, ``process`` (``core`` on
the engine core process's lines), then the record's
structured ``fields`` (a dict passed as ``extra={"fields": ...}``) and its ``request_id`` when it
has one, and ``exc_info`` (the traceback, as text) when it carries an exception.
"""
from __future__ import annotations

import json
import logging
from datetime import datetime, timezone

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    def __init__(self, process: str | None = None) -> None:
        super().__init__()
        self.process = process  # "core": a line of the engine core process

    def format(self, record: logging.LogRecord) -> str:
        out: dict = {"ts": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
                     "level": record.levelname, "logger": record.name,
                     "message": getattr(record, "json_message", None) or record.getMessage()}
        if self.process is not None:
            out["process"] = self.process
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            out.update(fields)
        request_id = getattr(record, "request_id", None)
        if request_id is not None:
            out.setdefault("request_id", request_id)
        if record.exc_info:
            out["exc_info"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack_info"] = self.formatStack(record.stack_info)
        return json.dumps(out, default=str)  # ASCII-escaped: one line, whatever the message holds


def check_log_format(log_format: str) -> None:
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log_format must be one of {', '.join(LOG_FORMATS)}, got {log_format!r}")


def format_root_handlers(formatter: logging.Formatter, *filters: logging.Filter) -> None:
    """Give every handler of the root logger ``formatter`` (and ``filters``). Python warnings
    become log records (logger ``py.warnings``) too, so that no line of another format reaches
    stderr between them."""
    logging.captureWarnings(True)
    for handler in logging.getLogger().handlers:
        handler.setFormatter(formatter)
        for f in filters:
            if f not in handler.filters:
                handler.addFilter(f)
