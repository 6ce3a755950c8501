"""Circuit breaking: only the worker's own failures count against it (edge/workers/failures.py),
seen through the worker pool with fake clients. Client errors and back-pressure never eject."""

from __future__ import annotations

import grpc
import pytest

from edge.errors import EdgeError, RateLimitError
from edge.workers.call import WorkerCall
from edge.workers.failures import WORKER_FAULTS_TO_EJECT, CallFailure, classify
from edge.workers.worker import WorkerStatus
from tests.unit.edge.edge_fakes import content, finished, run, started, usage
from tests.unit.edge.test_edge_worker_pool import REQUEST, Fakes, failure, make_pool

CLIENT_ERRORS = [
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.UNIMPLEMENTED,
]
NEVER_COUNTED = [
    *CLIENT_ERRORS,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
]
WORKER_FAULTS = [grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DATA_LOSS]


def test_every_status_code_has_one_class() -> None:
    assert classify(grpc.StatusCode.UNAVAILABLE) == CallFailure.DOWN
    assert all(classify(code) == CallFailure.WORKER_FAULT for code in WORKER_FAULTS)
    assert all(classify(code) == CallFailure.NOT_COUNTED for code in NEVER_COUNTED)
    classified = {grpc.StatusCode.UNAVAILABLE, *WORKER_FAULTS, *NEVER_COUNTED}
    assert classified == set(grpc.StatusCode) - {grpc.StatusCode.OK}


@pytest.mark.parametrize("code", NEVER_COUNTED, ids=lambda code: code.name)
def test_a_storm_of_errors_that_are_not_the_workers_never_ejects(code: grpc.StatusCode) -> None:
    fakes = Fakes()

    async def body() -> None:
        pool = make_pool(["a:1"], fakes, health_interval_s=60.0)
        fakes.clients["a:1"].script = lambda: [failure(code)]
        try:
            await pool.health()
            for _ in range(5 * WORKER_FAULTS_TO_EJECT):
                with pytest.raises(EdgeError):
                    await WorkerCall.open(pool, REQUEST, "r", 5.0)
            assert pool._workers["a:1"].status == WorkerStatus.SERVING
            assert pool._workers["a:1"].worker_faults == 0
            assert pool.outstanding() == {"a:1": 0}
        finally:
            await pool.close()

    run(body())


@pytest.mark.parametrize("code", CLIENT_ERRORS[:2], ids=lambda code: code.name)
def test_client_errors_mid_stream_never_eject(code: grpc.StatusCode) -> None:
    fakes = Fakes()

    async def body() -> None:
        pool = make_pool(["a:1"], fakes, health_interval_s=60.0)
        fakes.clients["a:1"].script = lambda: [started(), content("x"), failure(code)]
        try:
            await pool.health()
            for _ in range(2 * WORKER_FAULTS_TO_EJECT):
                stream = await WorkerCall.open(pool, REQUEST, "r", 5.0)
                with pytest.raises(EdgeError):
                    async for _event in stream:
                        pass
            assert pool._workers["a:1"].status == WorkerStatus.SERVING
        finally:
            await pool.close()

    run(body())


def test_back_pressure_moves_the_request_on_and_ejects_nobody() -> None:
    fakes = Fakes()

    async def body() -> None:
        pool = make_pool(["a:1", "b:2"], fakes, health_interval_s=60.0)
        fakes.clients["a:1"].script = lambda: [failure(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue_full")]
        try:
            await pool.health()
            pool._rotation = iter([0] * 20)  # type: ignore[assignment]  # a:1 is tried first
            for _ in range(2 * WORKER_FAULTS_TO_EJECT):
                stream = await WorkerCall.open(pool, REQUEST, "r", 5.0)
                assert stream.worker_address == "b:2"
                stream.cancel()
            assert pool._workers["a:1"].status == WorkerStatus.SERVING
            fakes.clients["b:2"].script = fakes.clients["a:1"].script
            with pytest.raises(RateLimitError):  # everyone busy: 429, still nobody ejected
                await WorkerCall.open(pool, REQUEST, "r", 5.0)
            assert all(w.status == WorkerStatus.SERVING for w in pool._workers.values())
        finally:
            await pool.close()

    run(body())


@pytest.mark.parametrize("code", WORKER_FAULTS, ids=lambda code: code.name)
def test_worker_faults_in_a_row_eject(code: grpc.StatusCode) -> None:
    fakes = Fakes()

    async def body() -> None:
        pool = make_pool(["a:1"], fakes, health_interval_s=60.0)
        fakes.clients["a:1"].script = lambda: [failure(code)]
        try:
            await pool.health()
            for _ in range(WORKER_FAULTS_TO_EJECT - 1):
                with pytest.raises(EdgeError):
                    await WorkerCall.open(pool, REQUEST, "r", 5.0)
            assert pool._workers["a:1"].status == WorkerStatus.SERVING  # one bad request is not enough
            with pytest.raises(EdgeError):
                await WorkerCall.open(pool, REQUEST, "r", 5.0)
            assert pool._workers["a:1"].status == WorkerStatus.UNREACHABLE
        finally:
            await pool.close()

    run(body())


def test_a_completed_call_clears_the_run_of_worker_faults() -> None:
    fakes = Fakes()
    good = [started(), content("hi"), finished(), usage()]
    bad = [started(), failure(grpc.StatusCode.INTERNAL)]
    # Each fault run stops one short of the threshold, then a call completes.
    plan = ([bad] * (WORKER_FAULTS_TO_EJECT - 1) + [good]) * 3

    async def body() -> None:
        pool = make_pool(["a:1"], fakes, health_interval_s=60.0)
        steps = iter(plan)
        fakes.clients["a:1"].script = lambda: list(next(steps))
        try:
            await pool.health()
            for _ in plan:
                stream = await WorkerCall.open(pool, REQUEST, "r", 5.0)
                try:
                    async for _event in stream:
                        pass
                except EdgeError:
                    pass
            assert pool._workers["a:1"].status == WorkerStatus.SERVING
            assert pool._workers["a:1"].worker_faults == 0
        finally:
            await pool.close()

    run(body())
