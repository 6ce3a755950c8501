"""Which failed worker calls count against the worker (circuit breaking), and which never do.

A worker pool that ejects a worker for an error the *caller* caused can be
emptied by one misbehaving client: a storm of invalid requests would eject
every worker in turn and leave all other callers with 503s (SGLang's router
once ejected a whole fleet on 4xx answers; its breaker now counts only
408/500/502/503/504). So the pool asks :func:`classify` about every failed
call, and only these count:

- ``UNAVAILABLE``: the transport failed (connection refused or reset, the
  process died) or the worker is draining or still loading. The worker
  cannot take calls now: it is ejected at once (:attr:`CallFailure.DOWN`)
  and re-checked with backoff.
- ``INTERNAL``, ``UNKNOWN``, ``DATA_LOSS``: the 500 family, the worker
  failed on its own side (a model failure, an unhandled exception, a
  corrupt message). One such answer may be one request's bad luck, so they
  are counted (:attr:`CallFailure.WORKER_FAULT`) and the worker is ejected
  after :data:`WORKER_FAULTS_TO_EJECT` in a row; a call that completes
  clears the count.

Timeouts that the edge measures against the worker itself (a worker that
does not accept a call within ``--worker-connect-timeout``, a health check
that gets no answer) eject it in :mod:`edge.workers.pool`, as ``DOWN`` does.
A call's own ``DEADLINE_EXCEEDED`` does **not** count: that deadline is
the request's budget, which the caller chooses (``X-Sluice-Timeout``), so
counting it would let a client with tiny timeouts eject the fleet; a worker
too slow to start calls is caught by the connect timeout instead.

Never counted (:attr:`CallFailure.NOT_COUNTED`): ``RESOURCE_EXHAUSTED``
(the worker's queue is full: back-pressure, a 429, not a fault; the pool
tries another worker before the first event), ``CANCELLED`` (the caller
went away), and every client error (``INVALID_ARGUMENT``, ``NOT_FOUND``,
``OUT_OF_RANGE``, ``FAILED_PRECONDITION``, ``PERMISSION_DENIED``,
``UNAUTHENTICATED``, ``ALREADY_EXISTS``, ``ABORTED``, ``UNIMPLEMENTED``:
the request was wrong or not for this server, not the worker broken).
"""

from __future__ import annotations

import enum

import grpc

# INTERNAL/UNKNOWN/DATA_LOSS answers in a row that eject a worker. More than one, so a single
# request that trips a model failure does not take a healthy worker out; few enough that a
# worker failing every call stops taking traffic within a handful of requests.
WORKER_FAULTS_TO_EJECT = 3


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
