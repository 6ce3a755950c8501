"""The edge's request logging: the request id in every log line, one line per answered request.

:func:`bind_request_id` (a ``before_request`` hook, after the id is
assigned) puts the request id into :data:`sluice.logs.request_id_var`, so
every record logged while handling the request (its stream included: the body
runs in the same task) carries it in the JSON format. :func:`log_request`
(an ``after_request`` hook) logs the method, path, status and time to the
response headers: INFO for ``/v1/*``, DEBUG for probes and scrapes, which
would otherwise drown the log. The end of a stream is logged by its pump
(:mod:`edge.streaming.pump`).

Nothing here logs a header, so API keys never reach the log.
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
    """Quart hook: one line per answered request (see the module docstring)."""
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
