"""The edge's request logging: the request id in every log line, one line per answered request.

Design notes: docs/edge-internals.md.
"""

from __future__ import annotations

import logging
import time

from quart import g, request
from quart.wrappers import Response

from edge.auth import PROTECTED_PREFIXES
from edge.http import current_request_id
from edge.request_log import RequestRecord
from edge.state import current_request, current_state
from sluice.logs import request_id_var

log = logging.getLogger("sluice.edge.request")


async def bind_request_id() -> None:
    """Quart hook: the current request's id becomes the log context's."""
    request_id_var.set(current_request_id())


async def log_request(response: Response) -> Response:
    """Quart hook: one line per answered request (docs/edge-internals.md, "Request logs")."""
    state = current_request()
    elapsed = time.monotonic() - state.started_at if state is not None else 0.0
    level = logging.INFO if request.path.startswith("/v1/") else logging.DEBUG
    log.log(
        level,
        "request %s: %s %s -> %d in %.3f s%s",
        current_request_id(),
        request.method,
        request.path,
        response.status_code,
        elapsed,
        " (stream follows)" if response.mimetype == "text/event-stream" else "",
    )
    return response


async def begin_request_log() -> None:
    """Quart hook (``--log-requests``, before the API-key check, so a 401 has its line too): an
    API request's record (:mod:`edge.request_log`)."""
    logger, state = current_state().request_log, current_request()
    if logger is not None and state is not None and request.path.startswith(PROTECTED_PREFIXES):
        state.log = logger.begin(state.request_id, request.method, request.path)


async def end_request_log(response: Response) -> Response:
    """Quart hook: the answered request's line, unless a stream follows (its line is written
    when it ends)."""
    logger, state = current_state().request_log, current_request()
    record = state.log if state is not None else None
    if logger is None or record is None:
        return response
    record.status = response.status_code
    record.key_id = g.get("api_key_id")
    if not (record.stream and response.mimetype == "text/event-stream"):
        logger.write(record, "completed" if response.status_code < 400 else "error")
    return response


def log_record() -> RequestRecord | None:
    """The current request's log record (``--log-requests``), if it has one."""
    state = current_request()
    return state.log if state is not None else None
