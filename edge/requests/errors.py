"""Each surface's error body from one :class:`~edge.errors.EdgeError`: OpenAI's, Anthropic's
(``/v1/messages``) or the native one (``/api/v1/*``); :func:`error_body` picks by request path,
so the app's one error handler answers every surface in its own shape (docs/http.md, "Errors").
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from edge.errors import EdgeError
from edge.requests.models import ResponseModel

ANTHROPIC_PREFIX = "/v1/messages"
NATIVE_PREFIX = "/api/v1/"

# Anthropic's error types by HTTP status (its documented list); others are api_error.
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
}


def anthropic_error(error: EdgeError) -> dict[str, Any]:
    """Anthropic's error body (also the data of its mid-stream ``error`` event)."""
    kind = _ANTHROPIC_TYPES.get(error.http_status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def native_error_type(error: EdgeError) -> str:
    """The native stream's error type: ``invalid_request``, ``model_not_found``,
    ``internal_error`` or ``unknown`` (limits, deadlines, overload)."""
    if error.code == "model_not_found":
        return "model_not_found"
    if error.http_status in (400, 401, 404, 405, 413, 422):
        return "invalid_request"
    if error.http_status == 500:
        return "internal_error"
    return "unknown"


def native_error(error: EdgeError) -> dict[str, Any]:
    """The ``error`` object of the native surface: type, message, code, param."""
    return {
        "type": native_error_type(error),
        "message": error.message,
        "code": error.code,
        "param": error.param,
    }


def native_error_body(error: EdgeError) -> dict[str, Any]:
    """The native surface's plain-HTTP error body."""
    return {"error": native_error(error)}


def error_body(path: str, error: EdgeError) -> dict[str, Any]:
    """The error body for a request to ``path``, in its surface's shape."""
    if path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/"):
        return anthropic_error(error)
    if path.startswith(NATIVE_PREFIX):
        return native_error_body(error)
    return error.payload()


class ErrorBody(ResponseModel):
    message: str
    type: str = Field(description="invalid_request_error, rate_limit_error, server_error, api_error, ...")
    param: str | None = Field(description="The request field at fault (a path like messages[0].role).")
    code: str | None = Field(description="A machine-readable code (invalid_value, invalid_api_key, ...).")


class ErrorResponse(ResponseModel):
    """Every error, before a stream began (a plain JSON answer) or in a mid-stream ``event: error``."""

    error: ErrorBody
