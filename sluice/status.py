"""Error details on the wire: the one encoding both services agree on.

Notes: docs/shared.md."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

DOMAIN = "sluice.v1"
DETAILS_KEY = "grpc-status-details-bin"
Metadata = Sequence[tuple[str, str | bytes]]


@dataclass(frozen=True)
class ErrorDetails:
    """What a failed call said, in a transport-neutral form."""

    code: grpc.StatusCode
    message: str
    reason: str = ""
    param: str | None = None
    retry_after_seconds: float | None = None
    load_fraction: float | None = None


def build_status(details: ErrorDetails) -> grpc.Status:
    """Builds a ``grpc.Status`` (for ``context.abort_with_status``) carrying the details."""
    metadata: dict[str, str] = {}
    if details.param:
        metadata["param"] = details.param
    if details.retry_after_seconds is not None:
        metadata["retry_after_seconds"] = f"{details.retry_after_seconds:g}"
    if details.load_fraction is not None:
        metadata["load_fraction"] = f"{details.load_fraction:.4g}"
    info = any_pb2.Any()
    info.Pack(error_details_pb2.ErrorInfo(reason=details.reason or "error", domain=DOMAIN, metadata=metadata))
    packed = [info]
    if details.param:
        bad = any_pb2.Any()
        violation = error_details_pb2.BadRequest.FieldViolation(
            field=details.param, description=details.message
        )
        bad.Pack(error_details_pb2.BadRequest(field_violations=[violation]))
        packed.append(bad)
    proto = status_pb2.Status(code=_rpc_code(details.code), message=details.message, details=packed)
    return rpc_status.to_status(proto)


def read_details(error: grpc.RpcError) -> ErrorDetails:
    """Reads code, message and details from a failed call; never raises."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    message = error.details() if hasattr(error, "details") else str(error)
    result = ErrorDetails(code=code or grpc.StatusCode.UNKNOWN, message=message or "")
    raw = _details_bytes(error)
    if raw is None:
        return result
    proto = status_pb2.Status()
    try:
        proto.ParseFromString(raw)
    except Exception:  # a peer that is not Sluice; keep code and message
        return result
    reason, param, retry, fraction = "", None, None, None
    for item in proto.details:
        if item.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            item.Unpack(info)
            reason = info.reason
            param = info.metadata.get("param") or param
            if "retry_after_seconds" in info.metadata:
                try:
                    retry = float(info.metadata["retry_after_seconds"])
                except ValueError:
                    retry = None
            if "load_fraction" in info.metadata:
                try:
                    fraction = float(info.metadata["load_fraction"])
                except ValueError:
                    fraction = None
    return ErrorDetails(result.code, result.message, reason, param, retry, fraction)


def _details_bytes(error: grpc.RpcError) -> bytes | None:
    trailing = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
    for key, value in trailing or ():
        if key == DETAILS_KEY and isinstance(value, bytes):
            return value
    return None


def _rpc_code(code: grpc.StatusCode) -> int:
    name = code.name
    return int(getattr(code_pb2, name, code_pb2.UNKNOWN))


class WorkerCallError(grpc.RpcError):
    """A failed worker call: gRPC code, message and Sluice's structured details.

    It is a ``grpc.RpcError`` with the same ``code()``, ``details()`` and
    ``trailing_metadata()`` methods as grpc's own errors, so code written for
    those (``sluice.status.read_details`` included) accepts it unchanged.
    """

    def __init__(self, status: ErrorDetails, trailing_metadata: Metadata = ()) -> None:
        super().__init__(f"{status.code.name}: {status.message}")
        self.status = status
        self._trailing_metadata = tuple(trailing_metadata)

    @classmethod
    def from_rpc_error(cls, error: grpc.RpcError) -> WorkerCallError:
        """Wraps a grpc error (reads its details once, never raises)."""
        if isinstance(error, WorkerCallError):
            return error
        trailing = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
        return cls(read_details(error), tuple(trailing or ()))

    def code(self) -> grpc.StatusCode:
        """The gRPC status code."""
        return self.status.code

    def details(self) -> str:
        """The status message (grpc's name for it)."""
        return self.status.message

    def trailing_metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        """The call's trailing metadata (holds the encoded status details)."""
        return self._trailing_metadata

    @property
    def message(self) -> str:
        return self.status.message

    @property
    def reason(self) -> str:
        """The worker's machine code (``invalid_parameter``, ``queue_full``, ``model_loading``,
        ``not_ready``...); empty when the failure did not come from a Sluice worker (e.g. a
        transport error)."""
        return self.status.reason

    @property
    def param(self) -> str | None:
        """The offending request field, when one is named."""
        return self.status.param

    @property
    def retry_after_seconds(self) -> float | None:
        """The worker's retry hint (``RESOURCE_EXHAUSTED``, ``UNAVAILABLE``), if any."""
        return self.status.retry_after_seconds
