"""Logging set-up shared by the edge and the worker: plain text or JSON lines, with request ids.

Notes: docs/shared.md."""

from __future__ import annotations

import json
import logging
import sys
import time
from contextvars import ContextVar
from typing import Any, TextIO

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# The id of the request being handled in this context (None outside one).
request_id_var: ContextVar[str | None] = ContextVar("sluice_request_id", default=None)


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time (UTC, ms), level, logger, message, request_id, worker_id."""

    def __init__(self, worker_id: str | None = None) -> None:
        super().__init__()
        self.worker_id = worker_id

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": _iso_time(record.created),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        # Stamped by RequestIdFilter at emit time; a record built elsewhere may carry its own.
        request_id = getattr(record, "request_id", None)
        if request_id:
            entry["request_id"] = request_id
        if self.worker_id:
            entry["worker_id"] = self.worker_id
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            entry["exception"] = record.exc_text
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        # default=str: a message argument that is not JSON-serializable must not lose the line.
        return json.dumps(entry, ensure_ascii=False, default=str)


class RequestIdFilter(logging.Filter):
    """Copies :data:`request_id_var` onto each record (``record.request_id``) as it is emitted.

    Attached to the handler, so it runs synchronously in the thread and
    context that logged: the right request's id, whatever the formatter does
    later. An explicit ``extra={"request_id": ...}`` wins.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = request_id_var.get()
        return True


def make_handler(fmt: str, *, worker_id: str | None = None, stream: TextIO | None = None) -> logging.Handler:
    """A stream handler (stderr by default) with the formatter for ``fmt`` and the request-id filter.

    Raises ``ValueError`` for an unknown ``fmt``.
    """
    if fmt not in LOG_FORMATS:
        raise ValueError(f"unknown log format {fmt!r}; expected one of {', '.join(LOG_FORMATS)}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter(worker_id) if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    handler.addFilter(RequestIdFilter())
    return handler


def configure_logging(level: str, fmt: str = "text", *, worker_id: str | None = None) -> None:
    """Replaces the root logger's handlers with one :func:`make_handler` handler at ``level``.

    Call once at start-up, before anything logs. ``level`` is a level name
    (``INFO``); ``fmt`` is ``text`` or ``json``.
    """
    # Per-record facts no format here writes (caller, thread, process) are not gathered: the
    # logging docs' optimizations, a third of a record's cost (one per request and stream).
    logging._srcfile = None  # type: ignore[attr-defined]
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(make_handler(fmt, worker_id=worker_id))
    root.setLevel(level.upper())


def _iso_time(created: float) -> str:
    seconds = int(created)
    millis = int((created - seconds) * 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{millis:03d}Z"
