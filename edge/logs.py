"""The edge's request logging: the request id in every log line, one line per answered request.

Design notes: docs/edge-internals.md.
"""

from __future__ import annotations

import logging
import time

from quart import request
from quart.wrappers import Response

from edge.http import current_request_id
from edge.state import current_request
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
