"""The Quart application: :func:`create_app` wires settings, worker pool, auth, routes and errors.

Before each request, in this order: the request id is assigned (so every
answer, errors included, carries ``X-Request-ID``), then the API key is
checked for ``/v1/*`` when keys are configured (:mod:`edge.auth`).

Every error leaves as the OpenAI error JSON (``{"error": {...}}``), never as
HTML or a traceback: edge errors with their own status, werkzeug HTTP errors
(unknown route 404, wrong method 405, body too large 413) mapped to the same
shape, and anything unexpected as a generic 500 (logged with its traceback).
"""

from __future__ import annotations

import logging

from quart import Quart, request
from quart.wrappers import Response
from werkzeug.exceptions import HTTPException, MethodNotAllowed

from edge.auth import ApiKeyCheck
from edge.errors import (
    GENERIC_INTERNAL_MESSAGE,
    EdgeError,
    InternalError,
    InvalidRequestError,
    MethodNotAllowedError,
    NotFoundError,
    PayloadTooLargeError,
)
from edge.routes import register_routes
from edge.routes.common import (
    POOL_KEY,
    SETTINGS_KEY,
    assign_request_id,
    current_pool,
    current_request_id,
    error_response,
)
from edge.settings import Settings
from edge.worker_pool import WorkerPool

log = logging.getLogger("sluice.edge")


def create_app(settings: Settings) -> Quart:
    """Builds the edge app. Channels open in ``before_serving`` (or on first use) and
    close in ``after_serving``; nothing connects at construction time."""
    app = Quart("edge")
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes
    app.extensions[SETTINGS_KEY] = settings
    app.extensions[POOL_KEY] = WorkerPool(
        settings.workers,
        connect_timeout_s=settings.worker_connect_timeout_s,
        health_timeout_s=settings.health_timeout_s,
    )

    @app.before_serving
    async def open_pool() -> None:
        current_pool().open()
        log.info("edge ready for workers %s", ", ".join(settings.workers))

    @app.after_serving
    async def close_pool() -> None:
        await current_pool().close()

    app.before_request(assign_request_id)
    api_keys = ApiKeyCheck(settings.api_keys)
    if api_keys.enabled:
        app.before_request(api_keys.before_request)

    @app.after_request
    async def add_request_id(response: Response) -> Response:
        response.headers.setdefault("X-Request-ID", current_request_id())
        return response

    @app.errorhandler(EdgeError)
    async def handle_edge_error(error: EdgeError) -> Response:
        return error_response(error)

    @app.errorhandler(HTTPException)
    async def handle_http_exception(error: HTTPException) -> Response:
        response = error_response(_from_http_exception(error))
        if isinstance(error, MethodNotAllowed) and error.valid_methods:
            response.headers["Allow"] = ", ".join(error.valid_methods)
        return response

    @app.errorhandler(Exception)
    async def handle_unexpected(error: Exception) -> Response:
        log.exception("request %s failed", current_request_id(), exc_info=error)
        return error_response(InternalError(GENERIC_INTERNAL_MESSAGE))

    register_routes(app)
    return app


def _from_http_exception(error: HTTPException) -> EdgeError:
    """werkzeug's routing and body errors, in the OpenAI shape."""
    status = error.code or 500
    if status == 404:
        return NotFoundError(f"Invalid URL ({request.method} {request.path}).")
    if status == 405:
        return MethodNotAllowedError(f"Method {request.method} is not allowed on {request.path}.")
    if status == 413:
        return PayloadTooLargeError(f"The request body is larger than {request.max_content_length} bytes.")
    if 400 <= status < 500:
        mapped: EdgeError = InvalidRequestError(error.description or error.name)
    else:
        mapped = InternalError(GENERIC_INTERNAL_MESSAGE)
    mapped.http_status = status
    return mapped
