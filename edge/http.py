"""Helpers shared by the route modules: JSON in and out, request ids, shortcuts to the app state.

The state itself is :mod:`edge.state` (one typed object per app, one per
request); :func:`current_pool` and :func:`current_settings` are shortcuts to it.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from quart import has_request_context, request
from quart.wrappers import Response

from edge.errors import EdgeError, InvalidRequestError
from edge.requests.errors import error_body
from edge.requests.limits import request_limits
from edge.requests.models import strict_fields
from edge.settings import Settings
from edge.state import begin_request, current_request, current_state
from edge.streaming.sse import dumps
from edge.workers.pool import WorkerPool

# A caller's X-Request-ID is echoed only if it is short and header-safe.
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:/+=@-]{1,128}$")


def current_pool() -> WorkerPool:
    """The app's worker pool (:attr:`edge.state.EdgeState.pool`)."""
    return current_state().pool


def current_settings() -> Settings:
    """The app's settings (:attr:`edge.state.EdgeState.settings`)."""
    return current_state().settings


async def assign_request_id() -> None:
    """Before each request (the first hook): echo a valid ``X-Request-ID`` or make one, and start
    the request's :class:`~edge.state.RequestState`.

    A coroutine although it never waits: Quart runs a plain function hook in a thread of its
    executor, a hop per request that cost the edge more than the hook's own work."""
    given = request.headers.get("X-Request-ID", "")
    begin_request(given if _REQUEST_ID.match(given) else f"req_{uuid.uuid4().hex}")


async def refuse_unknown_fields() -> None:
    """Before each request under ``--strict-fields``: a body field no request model knows is a 400
    naming it (:class:`~edge.requests.models.RequestModel`)."""
    strict_fields.set(True)


async def use_request_limits() -> None:
    """Before each request: the operator's request limits (``--max-messages``, the image settings ...)
    are the ones every surface's parser applies, the rewritten surfaces' included."""
    request_limits.set(current_settings().limits)


def current_request_id() -> str:
    """The current request's id (a fresh one if no hook ran, e.g. a routing error)."""
    state = current_request()
    if state is None:
        state = begin_request(f"req_{uuid.uuid4().hex}")
    return state.request_id


WORKER_HEADER = "X-Sluice-Worker-ID"


def worker_header(worker_ids: list[str]) -> dict[str, str]:
    """``X-Sluice-Worker-ID``: the serving workers' ids, comma-separated (absent when none)."""
    return {WORKER_HEADER: ",".join(worker_ids)} if worker_ids else {}


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    """Compact JSON with ``Content-Type: application/json``."""
    return Response(dumps(obj), status=status, headers=headers, content_type="application/json")


def error_response(error: EdgeError) -> Response:
    """The error body of the request's surface (OpenAI's, Anthropic's for ``/v1/messages``,
    the native one for ``/api/v1/*``: :mod:`edge.requests.errors`) with the error's status
    and headers (``Retry-After``)."""
    body = error_body(request.path, error) if has_request_context() else error.payload()
    return json_response(body, status=error.http_status, headers=error.headers())


async def read_json_body() -> Any:
    """The request body as decoded JSON.

    Raises :class:`InvalidRequestError` for a non-JSON content type or
    unparseable JSON; an over-limit body raises werkzeug's 413 from
    ``get_data`` (``MAX_CONTENT_LENGTH``), mapped by the app's handler.
    """
    if request.mimetype != "application/json":
        raise InvalidRequestError(
            f"Content-Type must be application/json, got {request.mimetype or 'none'!r}.",
            code="invalid_content_type",
        )
    data = await request.get_data(cache=False, as_text=False)
    try:
        return json.loads(data, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as error:
        raise InvalidRequestError(
            f"We could not parse the JSON body of your request ({_describe(error)}). "
            "The body must be a JSON object.",
            code="invalid_json",
        ) from None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _describe(error: Exception) -> str:
    if isinstance(error, RecursionError):
        return "nested too deeply"
    if isinstance(error, json.JSONDecodeError):
        return f"{error.msg} at line {error.lineno} column {error.colno}"
    return str(error)
