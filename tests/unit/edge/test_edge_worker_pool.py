"""The worker pool with fake clients: choice, ejection, backoff, re-admission, DNS, fast 503."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import grpc
import pytest

from edge.errors import EdgeError, RateLimitError, ServiceUnavailableError
from edge.workers.addresses import format_address, split_host_port
from edge.workers.call import WorkerCall
from edge.workers.pool import WorkerPool
from edge.workers.worker import EJECT_BACKOFF_INITIAL_S, WorkerStatus, eject_backoff_s
from sluice.client import ServingStatus, WorkerCallError, WorkerClient
from sluice.status import ErrorDetails
from sluice.v1 import worker_pb2
from tests.unit.edge.edge_fakes import content, finished, run, started, usage, wait_for

REQUEST = worker_pb2.GenerateRequest()
HANG = object()  # a FakeCall step: wait until cancelled


def failure(code: grpc.StatusCode, reason: str = "", message: str = "boom") -> WorkerCallError:
    return WorkerCallError(ErrorDetails(code, message, reason))


class FakeCall:
    """Plays ``steps`` (events, WorkerCallErrors or HANG) through the GenerateCall interface."""

    def __init__(self, steps: list[Any]) -> None:
        self._steps = list(steps)
        self.cancelled = False

    async def read(self) -> worker_pb2.GenerateResponse | None:
        if self.cancelled:
            raise failure(grpc.StatusCode.CANCELLED)
        if not self._steps:
            return None
        step = self._steps.pop(0)
        if step is HANG:
            self._steps.insert(0, step)
            await asyncio.Event().wait()
        if isinstance(step, WorkerCallError):
            raise step
        return cast(worker_pb2.GenerateResponse, step)

    def cancel(self) -> bool:
        self.cancelled = True
        return True


@dataclass
class FakeClient:
    """Stands in for WorkerClient: scripted health answers and Generate calls, counted."""

    address: str
    health_status: ServingStatus | WorkerCallError = ServingStatus.SERVING
    script: Callable[[], list[Any]] = lambda: [started(), content("hi"), finished(), usage()]
    health_checks: int = 0
    calls: list[FakeCall] = field(default_factory=list)
    closed: bool = False
    # Whether the channel is waiting out a reconnect backoff; closing makes a fresh one.
    channel_backing_off: bool = False
    channels_dropped: int = 0
    # What ListModels fails with (e.g. UNAVAILABLE model_loading), or None to answer.
    list_error: WorkerCallError | None = None
    streams_opened: int = 0  # requests opened with open_stream (the multiplexed call)

    def connect(self) -> None:
        pass

    def backing_off(self) -> bool:
        return self.channel_backing_off

    async def health(
        self,
        service: str = "",
        *,
        timeout: float | None = None,  # noqa: ASYNC109 (WorkerClient's signature)
    ) -> ServingStatus:
        self.health_checks += 1
        if isinstance(self.health_status, WorkerCallError):
            raise self.health_status
        return self.health_status

    def generate(self, request: Any, *, timeout: float | None = None, metadata: Any = ()) -> FakeCall:
        call = FakeCall(self.script())
        self.calls.append(call)
        return call

    def open_stream(self, request: Any, *, timeout: float | None = None, metadata: Any = ()) -> FakeCall:
        self.streams_opened += 1  # on the multiplexed call; read the same way
        return self.generate(request, timeout=timeout, metadata=metadata)

    async def list_models(
        self,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 (WorkerClient's signature)
    ) -> worker_pb2.ListModelsResponse:
        if self.list_error is not None:
            raise self.list_error
        return worker_pb2.ListModelsResponse(
            models=[worker_pb2.ModelInfo(id="m")], worker_id=f"id-{self.address}"
        )

    async def close(self, grace: float | None = None) -> None:
        self.closed = True
        if self.channel_backing_off:
            self.channels_dropped += 1
            self.channel_backing_off = False


class Fakes:
    """A client factory that remembers the fake it made for each address."""

    def __init__(self) -> None:
        self.clients: dict[str, FakeClient] = {}

    def __call__(self, address: str) -> WorkerClient:
        self.clients[address] = FakeClient(address)
        return cast(WorkerClient, self.clients[address])


def make_pool(addresses: list[str], fakes: Fakes | None = None, **overrides: Any) -> WorkerPool:
    options: dict[str, Any] = {
        "connect_timeout_s": 1.0,
        "health_timeout_s": 0.5,
        "health_interval_s": 0.2,
        "client_factory": fakes or Fakes(),
    }
    return WorkerPool(addresses, **{**options, **overrides})


def first_choices(pool: WorkerPool, count: int) -> list[str]:
    return [pool._candidates()[0].address for _ in range(count)]


# -- choice ------------------------------------------------------------------------------------


def test_ties_rotate_round_robin() -> None:
    pool = make_pool(["a:1", "b:2", "c:3"])
    assert first_choices(pool, 6) == ["a:1", "b:2", "c:3", "a:1", "b:2", "c:3"]


def test_least_outstanding_wins() -> None:
    pool = make_pool(["a:1", "b:2", "c:3"])
    a, b, c = pool._workers.values()
    a.outstanding, b.outstanding, c.outstanding = 2, 0, 1
    assert [w.address for w in pool._candidates()] == ["b:2", "c:3", "a:1"]


def test_ejected_and_removed_workers_are_not_candidates_unchecked_ones_are() -> None:
    pool = make_pool(["a:1", "b:2", "c:3", "d:4"])
    a, b, c, d = pool._workers.values()
    a.status, b.status, c.status = WorkerStatus.UNREACHABLE, WorkerStatus.NOT_SERVING, WorkerStatus.SERVING
    assert d.status == WorkerStatus.UNKNOWN
    assert sorted(w.address for w in pool._candidates()) == ["c:3", "d:4"]
    d.removed = True
    assert [w.address for w in pool._candidates()] == ["c:3"]


def test_a_pool_needs_workers_or_a_dns_name() -> None:
    with pytest.raises(ValueError, match="at least one"):
        WorkerPool([], connect_timeout_s=1, health_timeout_s=1)
    with pytest.raises(ValueError, match="host:port"):
        WorkerPool([], connect_timeout_s=1, health_timeout_s=1, dns_name="no-port")


def test_backoff_doubles_up_to_the_cap_with_jitter() -> None:
    assert [eject_backoff_s(n, cap_s=5.0) for n in range(1, 7)] == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0]
    assert eject_backoff_s(1, cap_s=0.1) == EJECT_BACKOFF_INITIAL_S  # never below the first step
    assert eject_backoff_s(10_000, cap_s=3.0) == 3.0
    assert eject_backoff_s(2, cap_s=5.0, jitter=0.2) == pytest.approx(1.2)


def test_address_helpers() -> None:
    assert split_host_port("workers.svc:50051") == ("workers.svc", 50051)
    assert split_host_port("[::1]:7") == ("::1", 7)
    assert format_address("::1", 7) == "[::1]:7" and format_address("10.0.0.1", 7) == "10.0.0.1:7"
    for bad in ("x", "x:", ":1", "x:0", "x:99999", "x:y"):
        with pytest.raises(ValueError, match="host:port"):
            split_host_port(bad)


# -- health loop -------------------------------------------------------------------------------


def test_health_loop_ejects_then_takes_back_with_backoff() -> None:
    fakes = Fakes()

    async def body() -> None:
        pool = make_pool(["a:1", "b:2"], fakes)
        fakes.clients["a:1"].health_status = ServingStatus.NOT_SERVING
        try:
            states = {h.address: h.status for h in await pool.health()}
            assert states == {"a:1": "NOT_SERVING", "b:2": "SERVING"}
            # Ejected: re-checked with backoff, never given a call meanwhile.
            for _ in range(4):
                stream = await WorkerCall.open(pool, REQUEST, "r", 5.0)
                assert stream.worker_address == "b:2"
                stream.cancel()
            checks_before = fakes.clients["a:1"].health_checks
            await asyncio.sleep(1.6)
            rechecks = fakes.clients["a:1"].health_checks - checks_before
            assert 1 <= rechecks <= 3, rechecks  # 0.5 s, 1 s, ... not every 0.2 s
            fakes.clients["a:1"].health_status = ServingStatus.SERVING
            await wait_for(lambda: pool._workers["a:1"].status == WorkerStatus.SERVING, within_s=5)
            assert {(await WorkerCall.open(pool, REQUEST, "r", 5.0)).worker_address for _ in range(4)} == {
                "a:1",
                "b:2",
            }
        finally:
            await pool.close()
        assert all(c.closed for c in fakes.clients.values())

    run(body())


def test_unreachable_on_health_check_is_ejected() -> None:
    fakes = Fakes()

    async def body() -> None:
        pool = make_pool(["a:1"], fakes)
        fakes.clients["a:1"].health_status = failure(grpc.StatusCode.UNAVAILABLE)
        try:
            assert [h.status for h in await pool.health()] == ["UNREACHABLE"]
        finally:
            await pool.close()

    run(body())


def test_a_channel_backing_off_is_replaced_at_each_failed_recheck() -> None:
    """A fresh channel per re-check: a restarted worker is not kept waiting by gRPC's backoff."""
    fakes = Fakes()

    async def body() -> None:
        pool = make_pool(["a:1"], fakes)
        client = fakes.clients["a:1"]
        client.health_status = failure(grpc.StatusCode.UNAVAILABLE)
        pool.open()
        try:
            for _ in range(3):
                client.channel_backing_off = True  # the failed connection put it in backoff
                await wait_for(lambda: not client.channel_backing_off, within_s=5)
            assert client.channels_dropped == 3
            assert pool.snapshot()[0].status == "UNREACHABLE"
            client.health_status = ServingStatus.SERVING
            await wait_for(lambda: pool.snapshot()[0].status == "SERVING", within_s=5)
        finally:
            await pool.close()

    run(body())


@pytest.mark.parametrize("case", ["a call is open on it", "not backing off (a stopped worker)"])
def test_a_channel_is_kept_when_it_carries_calls_or_is_not_backing_off(case: str) -> None:
    fakes = Fakes()

    async def body() -> None:
        pool = make_pool(["a:1"], fakes)
        client = fakes.clients["a:1"]
        if case == "a call is open on it":
            client.script = lambda: [started(), HANG]
            stream = await WorkerCall.open(pool, REQUEST, "r", 30.0)
            client.channel_backing_off = True
            client.health_status = failure(grpc.StatusCode.UNAVAILABLE)
        else:
            client.channel_backing_off = False
            client.health_status = failure(grpc.StatusCode.DEADLINE_EXCEEDED)
            pool.open()
        try:
            checks = client.health_checks
            await wait_for(lambda: client.health_checks >= checks + 3, within_s=10)
            assert client.channels_dropped == 0 and not client.closed
        finally:
            if case == "a call is open on it":
                stream.cancel()
            await pool.close()

    run(body())


# -- calls -------------------------------------------------------------------------------------


def test_unavailable_before_first_event_moves_on_and_ejects() -> None:
    fakes = Fakes()

    async def body() -> None:
        pool = make_pool(["a:1", "b:2"], fakes, health_interval_s=60.0)
        fakes.clients["a:1"].script = lambda: [failure(grpc.StatusCode.UNAVAILABLE)]
        try:
            await pool.health()  # both SERVING
            addresses = []
            for _ in range(4):
                stream = await WorkerCall.open(pool, REQUEST, "r", 5.0)
                addresses.append(stream.worker_address)
                kinds = [e.WhichOneof("event") async for e in stream]  # read to the end
                assert kinds[0] == "started" and kinds[-1] == "usage"
            assert addresses == ["b:2"] * 4
            assert len(fakes.clients["a:1"].calls) == 1  # tried once, then ejected
            assert pool._workers["a:1"].status == WorkerStatus.UNREACHABLE
            assert pool.outstanding() == {"a:1": 0, "b:2": 0}
        finally:
            await pool.close()

    run(body())


def test_draining_worker_is_marked_not_serving() -> None:
    fakes = Fakes()

    async def body() -> None:
        pool = make_pool(["a:1", "b:2"], fakes, health_interval_s=60.0)
        fakes.clients["a:1"].script = lambda: [failure(grpc.StatusCode.UNAVAILABLE, "not_ready")]
        try:
            await pool.health()
            pool._rotation = iter([0] * 10)  # type: ignore[assignment]  # a:1 first
            assert (await WorkerCall.open(pool, REQUEST, "r", 5.0)).worker_address == "b:2"
            assert pool._workers["a:1"].status == WorkerStatus.NOT_SERVING
        finally:
            await pool.close()

    run(body())


def test_busy_worker_moves_on_without_ejection() -> None:
    fakes = Fakes()

    async def body() -> None:
        pool = make_pool(["a:1", "b:2"], fakes, health_interval_s=60.0)
        for fake in fakes.clients.values():
            fake.script = lambda: [failure(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue_full")]
        try:
            await pool.health()
            with pytest.raises(RateLimitError) as caught:
                await WorkerCall.open(pool, REQUEST, "r", 5.0)
            assert caught.value.worker_id is not None  # the response names the busy worker
            assert all(len(f.calls) == 1 for f in fakes.clients.values())
            assert all(w.status == WorkerStatus.SERVING for w in pool._workers.values())
        finally:
            await pool.close()

    run(body())


def test_every_worker_known_down_is_503_at_once() -> None:
    fakes = Fakes()

    async def body() -> None:
        pool = make_pool(["a:1", "b:2"], fakes, health_interval_s=3.0)
        for fake in fakes.clients.values():
            fake.health_status = failure(grpc.StatusCode.UNAVAILABLE)
        try:
            await pool.health()
            loop = asyncio.get_running_loop()
            start = loop.time()
            with pytest.raises(ServiceUnavailableError) as caught:
                await WorkerCall.open(pool, REQUEST, "r", 5.0)
            assert loop.time() - start < 1.0  # answered at once: no worker was tried or waited for
            assert caught.value.retry_after is not None and 1.0 <= caught.value.retry_after <= 3.0
            assert not any(f.calls for f in fakes.clients.values())  # nothing was even tried
            with pytest.raises(ServiceUnavailableError):
                await pool.list_models()
        finally:
            await pool.close()

    run(body())


@pytest.mark.parametrize("multiplexed", [True, False])
def test_calls_go_on_the_multiplexed_call_when_the_pool_says_so(multiplexed: bool) -> None:
    fakes = Fakes()

    async def body() -> None:
        pool = make_pool(["a:1"], fakes, multiplexed=multiplexed)
        try:
            call = await WorkerCall.open(pool, REQUEST, "r", 5.0)
            assert [event.WhichOneof("event") async for event in call][-1] == "usage"
        finally:
            await pool.close()

    asyncio.run(body())
    client = fakes.clients["a:1"]
    assert (client.streams_opened, len(client.calls)) == ((1, 1) if multiplexed else (0, 1))


def test_failure_after_first_event_raises_and_ejects() -> None:
    fakes = Fakes()

    async def body() -> None:
        pool = make_pool(["a:1"], fakes, health_interval_s=60.0)
        fakes.clients["a:1"].script = lambda: [started(), content("x"), failure(grpc.StatusCode.UNAVAILABLE)]
        try:
            stream = await WorkerCall.open(pool, REQUEST, "r", 5.0)
            seen = []
            with pytest.raises(EdgeError) as caught:
                async for event in stream:
                    seen.append(event.WhichOneof("event"))
            assert seen == ["started", "content"]  # it stayed on its worker: no retry mid-stream
            assert isinstance(caught.value, ServiceUnavailableError)
            assert pool._workers["a:1"].status == WorkerStatus.UNREACHABLE
            assert pool.outstanding() == {"a:1": 0}
        finally:
            await pool.close()

    run(body())


def test_worker_that_does_not_accept_in_time_is_ejected() -> None:
    fakes = Fakes()

    async def body() -> None:
        pool = make_pool(["a:1", "b:2"], fakes, health_interval_s=60.0, connect_timeout_s=0.2)
        fakes.clients["a:1"].script = lambda: [HANG]
        try:
            await pool.health()
            pool._rotation = iter([0] * 10)  # type: ignore[assignment]  # a:1 first
            assert (await WorkerCall.open(pool, REQUEST, "r", 5.0)).worker_address == "b:2"
            assert fakes.clients["a:1"].calls[0].cancelled
            assert pool._workers["a:1"].status == WorkerStatus.UNREACHABLE
        finally:
            await pool.close()

    run(body())


def test_cancelled_caller_cancels_the_attempt_and_releases_the_slot() -> None:
    fakes = Fakes()

    async def body() -> None:
        pool = make_pool(["a:1"], fakes, connect_timeout_s=30.0)
        fakes.clients["a:1"].script = lambda: [HANG]
        try:
            task = asyncio.create_task(WorkerCall.open(pool, REQUEST, "r", 60.0))
            await wait_for(lambda: bool(fakes.clients["a:1"].calls))
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert fakes.clients["a:1"].calls[0].cancelled
            assert pool.outstanding() == {"a:1": 0}
        finally:
            await pool.close()

    run(body())


# -- DNS ---------------------------------------------------------------------------------------


def test_dns_adds_and_removes_workers_and_survives_resolution_failures() -> None:
    fakes = Fakes()
    answers: list[list[str] | OSError] = [["10.0.0.1:5", "10.0.0.2:5"]]
    asked: list[tuple[str, int]] = []

    async def resolver(host: str, port: int) -> list[str]:
        asked.append((host, port))
        answer = answers[0]
        if isinstance(answer, OSError):
            raise answer
        return answer

    async def body() -> None:
        pool = make_pool(
            ["static:9"], fakes, dns_name="workers.svc:5", dns_refresh_interval_s=0.1, resolver=resolver
        )
        try:
            states = {h.address: h.status for h in await pool.health()}
            assert states == {"static:9": "SERVING", "10.0.0.1:5": "SERVING", "10.0.0.2:5": "SERVING"}
            assert asked[0] == ("workers.svc", 5)
            # 10.0.0.1 leaves the answer while a call runs on it: no new calls, closed when idle.
            pool._rotation = iter([1] * 10)  # type: ignore[assignment]
            busy = await WorkerCall.open(pool, REQUEST, "r", 5.0)
            assert busy.worker_address == "10.0.0.1:5"
            answers[0] = ["10.0.0.2:5"]
            await wait_for(lambda: pool._workers["10.0.0.1:5"].removed)
            assert "10.0.0.1:5" not in [w.address for w in pool._candidates()]
            assert {h.address: h.status for h in pool.snapshot()}["10.0.0.1:5"] == "REMOVED"
            assert not fakes.clients["10.0.0.1:5"].closed
            busy.cancel()
            await wait_for(lambda: "10.0.0.1:5" not in pool.addresses)
            assert fakes.clients["10.0.0.1:5"].closed
            # A failed resolution keeps what we have.
            answers[0] = OSError("Name or service not known")
            count = len(asked)
            await wait_for(lambda: len(asked) > count + 1)
            assert sorted(pool.addresses) == ["10.0.0.2:5", "static:9"]
        finally:
            await pool.close()

    run(body())


def test_dns_only_pool_with_nothing_resolved_answers_503() -> None:
    async def resolver(host: str, port: int) -> list[str]:
        raise OSError("no such name")

    async def body() -> None:
        pool = make_pool([], dns_name="nothing.invalid:5", resolver=resolver)
        try:
            with pytest.raises(ServiceUnavailableError):
                await WorkerCall.open(pool, REQUEST, "r", 5.0)
            assert await pool.health() == []
        finally:
            await pool.close()

    run(body())


def test_real_resolver_on_localhost() -> None:
    from edge.workers.addresses import resolve

    addresses = asyncio.run(resolve("localhost", 4321))
    assert "127.0.0.1:4321" in addresses


# -- settings ----------------------------------------------------------------------------------


def test_pool_settings_from_flags_and_env(capsys: pytest.CaptureFixture[str]) -> None:
    from edge.settings import Settings

    settings = Settings.from_args(
        ["--worker-dns", "workers.svc:50051", "--health-interval", "2", "--dns-refresh-interval", "30"],
        env={},
    )
    assert settings.workers == () and settings.worker_dns == "workers.svc:50051"
    assert (settings.health_interval_s, settings.dns_refresh_interval_s) == (2.0, 30.0)
    both = Settings.from_args([], env={"SLUICE_EDGE_WORKERS": "a:1", "SLUICE_EDGE_WORKER_DNS": "b:2"})
    assert both.workers == ("a:1",) and both.worker_dns == "b:2"
    for argv, named in (
        ([], "--workers"),
        (["--worker-dns", "no-port"], "--worker-dns"),
        (["--workers", "a:1", "--health-interval", "0"], "--health-interval"),
        (["--workers", "a:1", "--dns-refresh-interval", "-1"], "--dns-refresh-interval"),
    ):
        with pytest.raises(SystemExit):
            Settings.from_args(argv, env={})
        assert named in capsys.readouterr().err


def loading(fraction: float) -> WorkerCallError:
    return WorkerCallError(
        ErrorDetails(grpc.StatusCode.UNAVAILABLE, "still loading", "model_loading", load_fraction=fraction)
    )


def load_progress(fraction: float) -> worker_pb2.GenerateResponse:
    return worker_pb2.GenerateResponse(
        progress=worker_pb2.Progress(stage=worker_pb2.Progress.MODEL_LOAD, fraction=fraction)
    )


def waiting(seconds: float) -> worker_pb2.GenerateRequest:
    return worker_pb2.GenerateRequest(model_load_wait_seconds=seconds)


def test_a_loading_worker_is_told_apart_from_draining_and_waited_for() -> None:
    fakes = Fakes()

    async def body() -> None:
        pool = make_pool(["a:1", "b:2"], fakes, health_interval_s=60.0)
        fakes.clients["a:1"].health_status = ServingStatus.NOT_SERVING
        fakes.clients["a:1"].list_error = loading(0.4)
        fakes.clients["b:2"].health_status = ServingStatus.NOT_SERVING  # draining: ListModels answers
        fakes.clients["a:1"].script = lambda: [load_progress(0.5), load_progress(1.0), started(), finished()]
        try:
            states = {h.address: (h.status, h.load_fraction) for h in await pool.health()}
            assert states == {"a:1": ("LOADING", 0.4), "b:2": ("NOT_SERVING", None)}
            # A request that may not wait gets today's 503 at once, with nothing tried.
            with pytest.raises(ServiceUnavailableError):
                await WorkerCall.open(pool, waiting(0), "r", 5.0)
            assert not fakes.clients["a:1"].calls and not fakes.clients["b:2"].calls
            # One that may wait goes to the loading worker; the load events are read here.
            stream = await WorkerCall.open(pool, waiting(30), "r", 5.0)
            assert stream.worker_address == "a:1" and stream.first.WhichOneof("event") == "started"
            assert [e.WhichOneof("event") async for e in stream] == ["started", "finished"]
            assert pool._workers["a:1"].status == WorkerStatus.SERVING  # it answered: loaded
            assert not fakes.clients["b:2"].calls  # never tried: draining is not loading
        finally:
            await pool.close()

    run(body())


def test_load_events_can_start_the_stream() -> None:
    fakes = Fakes()

    async def body() -> None:
        pool = make_pool(["a:1"], fakes, health_interval_s=60.0)
        fakes.clients["a:1"].health_status = ServingStatus.NOT_SERVING
        fakes.clients["a:1"].list_error = loading(0.1)
        fakes.clients["a:1"].script = lambda: [load_progress(0.5), started(), finished()]
        try:
            await pool.health()
            stream = await WorkerCall.open(pool, waiting(30), "r", 5.0, load_events=True)
            assert stream.first.WhichOneof("event") == "progress"
            assert [e.WhichOneof("event") async for e in stream] == ["progress", "started", "finished"]
        finally:
            await pool.close()

    run(body())


def test_a_load_that_outlasts_the_wait_is_503_and_not_waited_for_twice() -> None:
    fakes = Fakes()

    async def body() -> None:
        pool = make_pool(["a:1", "b:2"], fakes, health_interval_s=60.0)
        for fake in fakes.clients.values():
            fake.health_status = ServingStatus.NOT_SERVING
            fake.list_error = loading(0.2)
            fake.script = lambda: [load_progress(0.2), load_progress(0.3), loading(0.3)]
        try:
            await pool.health()
            with pytest.raises(ServiceUnavailableError):
                await WorkerCall.open(pool, waiting(30), "r", 5.0)
            assert sum(len(f.calls) for f in fakes.clients.values()) == 1
            assert {h.status for h in pool.snapshot()} == {"LOADING"}
            assert pool.outstanding() == {"a:1": 0, "b:2": 0}
        finally:
            await pool.close()

    run(body())
