"""Which failed worker calls count against the worker (circuit breaking), and which never do; which
go to the next worker when they fail before their first event.

Design notes: docs/edge-internals.md.
"""

from __future__ import annotations

import enum

import grpc

# INTERNAL/UNKNOWN/DATA_LOSS answers in a row that eject a worker. More than one, so a single
# request that trips a model failure does not take a healthy worker out; few enough that a
# worker failing every call stops taking traffic within a handful of requests.
WORKER_FAULTS_TO_EJECT = 3
# A call that fails with one of these before its first event is tried on the next worker: the worker
# is down, starting or draining (UNAVAILABLE), or its queue is full (RESOURCE_EXHAUSTED).
RETRY_ELSEWHERE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED})


class CallFailure(enum.Enum):
    """What a failed call says about the worker that answered it."""

    DOWN = "down"  # eject now
    WORKER_FAULT = "worker_fault"  # count; eject after WORKER_FAULTS_TO_EJECT in a row
    NOT_COUNTED = "not_counted"  # the caller's doing, or back-pressure


_DOWN = frozenset({grpc.StatusCode.UNAVAILABLE})
_WORKER_FAULTS = frozenset({grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DATA_LOSS})


def classify(code: grpc.StatusCode) -> CallFailure:
    """How a call that ended with ``code`` counts against its worker (see the module doc)."""
    if code in _DOWN:
        return CallFailure.DOWN
    if code in _WORKER_FAULTS:
        return CallFailure.WORKER_FAULT
    return CallFailure.NOT_COUNTED
