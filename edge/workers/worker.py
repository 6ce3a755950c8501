"""One worker as the pool sees it: its status, its record (client, counters, backoff) and the
public views of it (:class:`WorkerHealth`, :class:`ModelListing`)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from sluice.client import WorkerClient
from sluice.v1 import worker_pb2

# First re-check of an ejected worker; doubles per failure up to the health interval.
EJECT_BACKOFF_INITIAL_S = 0.5
# The worker's status-details reason for "still loading its model" (worker.errors.ModelLoading).
MODEL_LOADING_REASON = "model_loading"


class WorkerStatus(enum.StrEnum):
    """A worker's state in the pool. Only UNKNOWN (not checked yet) and SERVING take calls."""

    UNKNOWN = "UNKNOWN"
    SERVING = "SERVING"
    NOT_SERVING = "NOT_SERVING"  # answered, but not serving (draining, or an older worker loading)
    LOADING = "LOADING"  # answered: still loading its model (takes calls that may wait for it)
    UNREACHABLE = "UNREACHABLE"  # no answer: down, or the network
    REMOVED = "REMOVED"  # left the DNS answer; closed once its calls end


def is_model_load(event: worker_pb2.GenerateResponse | None) -> bool:
    return (
        event is not None
        and event.WhichOneof("event") == "progress"
        and event.progress.stage == worker_pb2.Progress.MODEL_LOAD
    )


def eject_backoff_s(failures: int, cap_s: float, jitter: float = 0.0) -> float:
    """Seconds until an ejected worker's next check after ``failures`` consecutive failures
    (>= 1): 0.5, 1, 2, ... capped at ``cap_s``, times ``1 + jitter`` (jitter in [-0.2, 0.2]
    spreads the checks of many edges)."""
    base = min(max(cap_s, EJECT_BACKOFF_INITIAL_S), EJECT_BACKOFF_INITIAL_S * 2 ** min(failures - 1, 30))
    return base * (1.0 + jitter)


class Worker:
    """One worker address: its client (channel), health state and live counters."""

    def __init__(self, address: str, client: WorkerClient, *, static: bool) -> None:
        self.address = address
        self.client = client
        # Static workers (--workers) stay forever; DNS ones leave with their address.
        self.static = static
        self.outstanding = 0
        self.status = WorkerStatus.UNKNOWN
        self.removed = False
        # Consecutive failures (checks or calls) since the last SERVING answer.
        self.failures = 0
        # INTERNAL/UNKNOWN/DATA_LOSS answers since the last call that completed (edge.workers.failures).
        self.worker_faults = 0
        self.next_check_at = 0.0  # monotonic; 0 = due now
        # The worker's own id (``started.worker_id``), learned from its answers.
        self.worker_id: str | None = None
        # While LOADING: how far its model load has come (0 to 1), as it last said.
        self.load_fraction: float | None = None
        # What it serves (its last ListModels answer; None: not asked since it last came back).
        self.models: list[worker_pb2.ModelInfo] | None = None

    def serves(self, model: str, tasks: tuple[str, ...]) -> bool:
        """Whether its last listing has ``model`` (any, when empty) for one of ``tasks`` (a worker
        older than ``ModelInfo.task`` generates)."""
        return any((m.task or "generate") in tasks and model in ("", m.id) for m in self.models or ())

    @property
    def available(self) -> bool:
        """May take a new call: not removed, and SERVING or not checked yet."""
        return not self.removed and self.status in (WorkerStatus.UNKNOWN, WorkerStatus.SERVING)


@dataclass(frozen=True)
class ModelListing:
    """The models the reachable workers serve, and the ids of the workers that answered."""

    models: list[worker_pb2.ModelInfo]
    worker_ids: list[str]


@dataclass(frozen=True)
class WorkerHealth:
    """One worker's state in the pool (a :class:`WorkerStatus` name) and its calls in flight."""

    address: str
    status: str
    outstanding: int
    load_fraction: float | None = None  # while LOADING, when the worker said

    @property
    def serving(self) -> bool:
        return self.status == WorkerStatus.SERVING
