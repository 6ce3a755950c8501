"""The worker's exception tree and its one mapping to gRPC statuses."""

from __future__ import annotations

import grpc

from sluice.status import ErrorDetails, build_status


class WorkerError(Exception):
    """Base of every error the worker reports to a caller."""

    code = grpc.StatusCode.INTERNAL
    reason = "internal_error"

    def __init__(self, message: str, *, param: str | None = None, retry_after_seconds: float | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.retry_after_seconds = retry_after_seconds

    def to_status(self) -> grpc.Status:
        return build_status(
            ErrorDetails(self.code, self.message, self.reason, self.param, self.retry_after_seconds)
        )


class InvalidRequest(WorkerError):
    code = grpc.StatusCode.INVALID_ARGUMENT
    reason = "invalid_parameter"


class ModelNotFound(WorkerError):
    code = grpc.StatusCode.NOT_FOUND
    reason = "model_not_found"


class QueueFull(WorkerError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = "queue_full"


class DeadlineUnreachable(WorkerError):
    """Refused at admission: the request could not finish before its caller's deadline, so it fails
    now with the status the deadline itself would give."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED
    reason = "deadline_unreachable"


class NotReady(WorkerError):
    code = grpc.StatusCode.UNAVAILABLE
    reason = "not_ready"


class ModelLoading(NotReady):
    """The model is still loading; ``load_fraction`` (0 to 1) says how far it has come."""

    reason = "model_loading"

    def __init__(self, message: str, *, load_fraction: float, retry_after_seconds: float | None = None):
        super().__init__(message, retry_after_seconds=retry_after_seconds)
        self.load_fraction = load_fraction

    def to_status(self) -> grpc.Status:
        return build_status(
            ErrorDetails(
                self.code,
                self.message,
                self.reason,
                retry_after_seconds=self.retry_after_seconds,
                load_fraction=self.load_fraction,
            )
        )


class GenerationFailed(WorkerError):
    code = grpc.StatusCode.INTERNAL
    reason = "generation_failed"


class WrongTask(WorkerError):
    """The call asks for what this worker's ``--task`` does not serve (Generate on an embedder)."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "wrong_task"


class LoraNotEnabled(WorkerError):
    """A LoRA adapter call to a worker started without ``--enable-lora``."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "lora_not_enabled"
