"""The one gRPC → HTTP error mapping, as a table."""

from __future__ import annotations

import grpc
import pytest

from edge.errors import EdgeError, InvalidRequestError, from_grpc, stream_error_payload
from sluice.status import ErrorDetails, build_status


def rpc_error(details: ErrorDetails) -> grpc.aio.AioRpcError:
    status = build_status(details)
    return grpc.aio.AioRpcError(
        code=details.code,
        initial_metadata=grpc.aio.Metadata(),
        trailing_metadata=grpc.aio.Metadata(*status.trailing_metadata),
        details=details.message,
    )


def bare_rpc_error(code: grpc.StatusCode, message: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=message)


@pytest.mark.parametrize(
    ("details", "status", "type_", "code", "param", "retry_after"),
    [
        (
            ErrorDetails(
                grpc.StatusCode.INVALID_ARGUMENT, "temperature too hot", "invalid_parameter", "temperature"
            ),
            400,
            "invalid_request_error",
            "invalid_parameter",
            "temperature",
            None,
        ),
        (
            ErrorDetails(grpc.StatusCode.NOT_FOUND, "no such model", "model_not_found", "model"),
            404,
            "invalid_request_error",
            "model_not_found",
            "model",
            None,
        ),
        (
            ErrorDetails(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full", "queue_full", None, 2.5),
            429,
            "rate_limit_error",
            "queue_full",
            None,
            "3",
        ),
        (
            ErrorDetails(grpc.StatusCode.UNAVAILABLE, "draining", "draining", None, 4),
            503,
            "server_error",
            "draining",
            None,
            "4",
        ),
        (
            ErrorDetails(grpc.StatusCode.DEADLINE_EXCEEDED, "late"),
            504,
            "timeout_error",
            "timeout",
            None,
            None,
        ),
        (ErrorDetails(grpc.StatusCode.CANCELLED, "bye"), 499, "api_error", "cancelled", None, None),
        (ErrorDetails(grpc.StatusCode.INTERNAL, "CUDA oom"), 500, "api_error", "internal_error", None, None),
        (ErrorDetails(grpc.StatusCode.UNKNOWN, "x"), 500, "api_error", "internal_error", None, None),
    ],
)
def test_grpc_mapping_table(
    details: ErrorDetails, status: int, type_: str, code: str, param: str | None, retry_after: str | None
) -> None:
    error = from_grpc(rpc_error(details))
    assert error.http_status == status
    body = error.payload()["error"]
    assert (body["type"], body["code"], body["param"]) == (type_, code, param)
    assert error.headers().get("Retry-After") == retry_after
    if status < 499:  # caller errors keep the worker's message
        assert body["message"] == details.message


def test_transport_and_internal_messages_are_not_leaked() -> None:
    unavailable = from_grpc(
        bare_rpc_error(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses; ipv4:10.0.0.7:50051")
    )
    assert unavailable.http_status == 503
    assert "10.0.0.7" not in unavailable.message
    assert unavailable.headers() == {"Retry-After": "1"}
    internal = from_grpc(
        bare_rpc_error(grpc.StatusCode.INTERNAL, 'Traceback (most recent call last): File "/x.py"')
    )
    assert "Traceback" not in internal.message and "/x.py" not in internal.message


def test_invalid_argument_without_details_still_maps() -> None:
    error = from_grpc(bare_rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "bad"))
    assert (error.http_status, error.param, error.message) == (400, None, "bad")


def test_stream_error_payload() -> None:
    assert stream_error_payload(InvalidRequestError("x", param="n")) == {
        "error": {"message": "x", "type": "invalid_request_error", "param": "n", "code": None}
    }
    generic = stream_error_payload(RuntimeError("secret detail"))["error"]
    assert generic["type"] == "api_error" and "secret" not in generic["message"]
    assert isinstance(from_grpc(bare_rpc_error(grpc.StatusCode.CANCELLED, "")), EdgeError)
