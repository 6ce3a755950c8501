"""The edge's one exception tree and its mapping to HTTP and SSE.

Design notes: docs/edge-internals.md.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import grpc

from sluice.status import read_details

log = logging.getLogger("sluice.edge")


class EdgeError(Exception):
    """Base of every error the edge answers with.

    Subclasses fix ``http_status`` and ``type``; ``code`` and ``param`` may be
    given per instance. ``retry_after`` (seconds) becomes a ``Retry-After``
    header on plain HTTP answers.
    """

    http_status: int = 500
    type: str = "api_error"
    default_code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code if code is not None else self.default_code
        self.retry_after = retry_after
        self.worker_id: str | None = None
        self.extra_headers: dict[str, str] = {}

    def payload(self) -> dict[str, Any]:
        """The OpenAI error body; also the data of a mid-stream ``event: error``."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def headers(self) -> dict[str, str]:
        """Extra response headers for a plain HTTP answer: ``Retry-After``,
        ``X-Sluice-Worker-ID`` and any ``extra_headers``."""
        headers = dict(self.extra_headers)
        if self.retry_after is not None:
            # Retry-After takes whole seconds; round up so clients never retry early.
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after)))
        if self.worker_id:
            headers["X-Sluice-Worker-ID"] = self.worker_id
        return headers


class InvalidRequestError(EdgeError):
    """The request is wrong (400); ``param`` names the field when known."""

    http_status = 400
    type = "invalid_request_error"


# On a refusal sent before the request's body was read (a key or rate check in a ``before_request``
# hook): hypercorn closes such a connection once the response is out, so the response says so, and
# a client never sends its next request down a connection that is closing.
BODY_UNREAD = {"Connection": "close"}


class AuthenticationError(EdgeError):
    """A missing or wrong API key (401, OpenAI's ``invalid_api_key``)."""

    http_status = 401
    type = "invalid_request_error"
    default_code = "invalid_api_key"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.extra_headers["WWW-Authenticate"] = "Bearer"
        self.extra_headers.update(BODY_UNREAD)


class UnprocessableEntityError(EdgeError):
    """A body that is well-formed JSON but not a JSON object (422)."""

    http_status = 422
    type = "invalid_request_error"
    default_code = "invalid_type"


class NotFoundError(EdgeError):
    """An unknown model or route (404)."""

    http_status = 404
    type = "invalid_request_error"


class MethodNotAllowedError(EdgeError):
    """A known route called with the wrong method (405)."""

    http_status = 405
    type = "invalid_request_error"


class PayloadTooLargeError(EdgeError):
    """The request body is over the configured limit (413)."""

    http_status = 413
    type = "invalid_request_error"
    default_code = "request_too_large"


class RateLimitError(EdgeError):
    """Every worker's admission queue is full (429, with ``Retry-After``)."""

    http_status = 429
    type = "rate_limit_error"
    default_code = "rate_limit_exceeded"


class ServiceUnavailableError(EdgeError):
    """No worker can take the request now (503, with ``Retry-After``)."""

    http_status = 503
    type = "server_error"
    default_code = "service_unavailable"


class DeadlineExceededError(EdgeError):
    """The request's deadline passed (504)."""

    http_status = 504
    type = "timeout_error"
    default_code = "timeout"


class StreamIdleTimeoutError(EdgeError):
    """The worker sent nothing (not even a progress event) for the request's idle timeout (504)."""

    http_status = 504
    type = "stream_idle_timeout"
    default_code = "stream_idle_timeout"


class ServerShuttingDownError(EdgeError):
    """The edge is draining: a new request is refused (503, ``Retry-After``, so a client or load
    balancer retries another replica) and a stream still open when the grace period ends is cut."""

    http_status = 503
    type = "server_error"
    default_code = "server_shutting_down"


class CallCancelledError(EdgeError):
    """The worker cancelled the call (nginx's 499: the request did not complete)."""

    http_status = 499
    type = "api_error"
    default_code = "cancelled"


class InternalError(EdgeError):
    """A bug or a model failure (500); the message is deliberately generic."""

    http_status = 500
    type = "api_error"
    default_code = "internal_error"


GENERIC_INTERNAL_MESSAGE = "The server had an error while processing your request."
# Retry hint for UNAVAILABLE without a worker-given one: a restart or a drain.
DEFAULT_UNAVAILABLE_RETRY_S = 1.0


def from_grpc(error: grpc.RpcError) -> EdgeError:
    """Maps a failed worker call to the edge error the caller sees.

    The only gRPC → HTTP mapping in the edge. Worker-authored messages (those
    carrying Sluice details, see :mod:`sluice.status`) are passed through for
    caller errors; transport messages (which can name addresses) and internal
    failures are replaced by generic text and logged here instead.
    """
    details = read_details(error)
    code = details.code
    reason = details.reason or None
    from_worker = bool(details.reason)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidRequestError(
            details.message or "Invalid request.", param=details.param, code=reason or "invalid_value"
        )
    if code == grpc.StatusCode.FAILED_PRECONDITION and from_worker:
        # The worker's --task does not serve this endpoint (an embedder asked to generate).
        return InvalidRequestError(details.message, param=details.param or "model", code=reason)
    if code == grpc.StatusCode.NOT_FOUND:
        return NotFoundError(
            details.message or "The model does not exist.",
            param=details.param or "model",
            code="model_not_found",
        )
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return RateLimitError(
            details.message if from_worker else "The server is busy; please retry later.",
            code=reason,
            retry_after=details.retry_after_seconds if details.retry_after_seconds is not None else 1.0,
        )
    if code == grpc.StatusCode.UNAVAILABLE:
        if not from_worker:
            log.warning("worker unavailable: %s", details.message)
        return ServiceUnavailableError(
            details.message if from_worker else "No model worker is available; please retry later.",
            code=reason,
            retry_after=(
                details.retry_after_seconds
                if details.retry_after_seconds is not None
                else DEFAULT_UNAVAILABLE_RETRY_S
            ),
        )
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineExceededError("The request timed out.", code="timeout")
    if code == grpc.StatusCode.CANCELLED:
        return CallCancelledError("The request was cancelled.", code="cancelled")
    log.error("worker call failed with %s: %s", code.name if code else "UNKNOWN", details.message)
    return InternalError(GENERIC_INTERNAL_MESSAGE)


def stream_error_payload(error: BaseException) -> dict[str, Any]:
    """The data of a mid-stream ``event: error`` frame for any exception.

    An :class:`EdgeError` keeps its own payload; anything else is a bug in the
    edge and is reported as a generic internal error (the traceback is logged
    by the caller, never sent).
    """
    if isinstance(error, EdgeError):
        return error.payload()
    return InternalError(GENERIC_INTERNAL_MESSAGE).payload()
