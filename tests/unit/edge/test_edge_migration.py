"""Stream migration (edge/workers/call.py's WorkerCall, edge/workers/migration.py's policy and
delivery record) with fake workers: what is resent, what the caller reads."""

from __future__ import annotations

from typing import Any, cast

import grpc
import pytest

from edge.errors import EdgeError, InternalError, ServiceUnavailableError
from edge.settings import Settings
from edge.workers.call import WorkerCall
from edge.workers.migration import MigrationPolicy
from edge.workers.pool import WorkerPool
from sluice.client import WorkerClient
from sluice.v1 import worker_pb2
from tests.unit.edge.edge_fakes import content, finished, run, usage
from tests.unit.edge.test_edge_worker_pool import FakeCall, FakeClient, failure, make_pool

DIED = failure(grpc.StatusCode.UNAVAILABLE, message="Stream removed")


def started(resumable: bool = True) -> worker_pb2.GenerateResponse:
    return worker_pb2.GenerateResponse(started=worker_pb2.Started(worker_id="w", n=1, resumable=resumable))


def progress() -> worker_pb2.GenerateResponse:
    return worker_pb2.GenerateResponse(progress=worker_pb2.Progress(stage=worker_pb2.Progress.QUEUED))


class ScriptedClient(FakeClient):
    """A fake worker whose calls play the given scripts in turn; remembers each call's request."""

    def __init__(self, address: str, scripts: list[list[Any]]) -> None:
        super().__init__(address)
        self.scripts = scripts
        self.requests: list[worker_pb2.GenerateRequest] = []

    def generate(self, request: Any, *, timeout: float | None = None, metadata: Any = ()) -> FakeCall:
        self.requests.append(request)
        call = FakeCall(self.scripts.pop(0))
        self.calls.append(call)
        return call


class Counted:
    def __init__(self) -> None:
        self.outcomes: list[str] = []

    def stream_migration(self, outcome: str) -> None:
        self.outcomes.append(outcome)


def pool_of(scripts: dict[str, list[list[Any]]]) -> tuple[WorkerPool, dict[str, ScriptedClient]]:
    clients = {address: ScriptedClient(address, list(s)) for address, s in scripts.items()}
    # The first address takes the first call (fewest outstanding, then rotation from the first).
    pool = make_pool(list(scripts), client_factory=lambda address: cast(WorkerClient, clients[address]))
    return pool, clients


def read_all(
    pool: WorkerPool, request: worker_pb2.GenerateRequest, *, max_migrations: int = 2
) -> tuple[list[worker_pb2.GenerateResponse], EdgeError | None, Counted]:
    metrics = Counted()

    async def go() -> tuple[list[worker_pb2.GenerateResponse], EdgeError | None]:
        stream = await WorkerCall.open(
            pool, request, "req", 30.0, migration=MigrationPolicy(max_migrations, metrics)
        )
        events: list[worker_pb2.GenerateResponse] = []
        try:
            async for event in stream:
                events.append(event)
        except EdgeError as error:
            return events, error
        finally:
            await pool.close()
        return events, None

    events, error = run(go())
    return events, error, metrics


def texts(events: list[worker_pb2.GenerateResponse]) -> str:
    return "".join(e.content.text for e in events if e.WhichOneof("event") == "content")


def request(n: int | None = None) -> worker_pb2.GenerateRequest:
    req = worker_pb2.GenerateRequest(request_id="req", return_token_ids=True)
    req.sampling.prompt_logprobs = 2
    if n is not None:
        req.sampling.n = n
    return req


def test_a_dead_worker_s_call_resumes_elsewhere_without_repeating_text() -> None:
    pool, clients = pool_of(
        {
            "a:1": [[started(), content("Hel", token_ids=(1, 2)), content("lo", token_ids=()), DIED]],
            "b:1": [
                [
                    started(),
                    progress(),
                    content("lo", token_ids=(3,)),
                    content(" world", token_ids=(4,)),
                    finished(tokens=4),
                    usage(completion=4),
                ]
            ],
        }
    )
    events, error, metrics = read_all(pool, request())
    assert error is None
    assert texts(events) == "Hello world"
    kinds = [e.WhichOneof("event") for e in events]
    assert kinds == ["started", "content", "content", "content", "finished", "usage"]
    assert events[0].started.worker_id == "w" and events[-1].usage.completion_tokens == 4
    resumed = clients["b:1"].requests[0]
    assert list(resumed.resume.choices[0].ids) == [1, 2]  # "lo" had no ids yet: sent again by b
    assert resumed.return_token_ids and not resumed.sampling.HasField("prompt_logprobs")
    assert metrics.outcomes == ["resumed"]


def test_request_level_failures_are_not_migrated() -> None:
    pool, clients = pool_of(
        {
            "a:1": [[started(), content("x", token_ids=(1,)), failure(grpc.StatusCode.INTERNAL)]],
            "b:1": [],
        }
    )
    events, error, metrics = read_all(pool, request())
    assert isinstance(error, InternalError) and texts(events) == "x"
    assert clients["b:1"].requests == [] and metrics.outcomes == []


def test_the_migration_limit_ends_with_the_error() -> None:
    pool, _clients = pool_of(
        {
            "a:1": [[started(), content("a", token_ids=(1,)), DIED]],
            "b:1": [[started(), content("b", token_ids=(2,)), DIED]],
        }
    )
    events, error, metrics = read_all(pool, request(), max_migrations=1)
    assert isinstance(error, ServiceUnavailableError) and texts(events) == "ab"
    assert metrics.outcomes == ["resumed", "limit_reached"]


def test_several_choices_or_an_old_worker_are_not_resumable() -> None:
    for req, first in ((request(n=2), started()), (request(), started(resumable=False))):
        pool, clients = pool_of(
            {"a:1": [[first, content("a", token_ids=()), content("b", token_ids=(2,)), DIED]], "b:1": []}
        )
        events, error, metrics = read_all(pool, req)
        assert isinstance(error, ServiceUnavailableError) and texts(events) == "ab"  # nothing held
        assert metrics.outcomes == ["not_resumable"] and clients["b:1"].requests == []


def test_held_deltas_go_out_before_the_error_when_nobody_takes_the_rest() -> None:
    pool, _clients = pool_of(
        {
            "a:1": [[started(), content("a", token_ids=(1,)), content("b", token_ids=()), DIED]],
            "b:1": [[DIED]],
        }
    )
    events, error, metrics = read_all(pool, request())
    assert isinstance(error, ServiceUnavailableError) and texts(events) == "ab"
    assert metrics.outcomes == ["failed"]


def test_a_call_that_only_lost_its_usage_ends_normally() -> None:
    pool, clients = pool_of(
        {"a:1": [[started(), content("a", token_ids=(1,)), finished(tokens=1), DIED]], "b:1": []}
    )
    events, error, _metrics = read_all(pool, request())
    assert error is None and texts(events) == "a" and events[-1].WhichOneof("event") == "finished"
    assert clients["b:1"].requests == []


def test_settings_turn_migration_off_and_bound_it() -> None:
    default = Settings.from_args(["--workers", "a:1"], env={})
    assert default.migrate_streams and default.max_stream_migrations == 2
    off = Settings.from_args(["--workers", "a:1"], env={"SLUICE_EDGE_MIGRATE_STREAMS": "false"})
    assert not off.migrate_streams
    for bad in (["--migrate-streams", "maybe"], ["--max-stream-migrations", "17"]):
        with pytest.raises(SystemExit):
            Settings.from_args(["--workers", "a:1", *bad], env={})


def test_a_moved_call_holds_one_worker_slot_at_a_time() -> None:
    pool, _clients = pool_of(
        {
            "a:1": [[started(), content("a", token_ids=(1,)), DIED]],
            "b:1": [[started(), content("b", token_ids=(2,)), finished(tokens=2), usage(completion=2)]],
        }
    )
    slots: list[dict[str, int]] = []

    async def go() -> str:
        call = await WorkerCall.open(pool, request(), "req", 30.0, migration=MigrationPolicy(2))
        text = ""
        async for event in call:
            text += event.content.text
            slots.append({w.address: w.outstanding for w in pool._workers.values()})
        await pool.close()
        return text

    assert run(go()) == "ab"
    assert slots[0] == {"a:1": 1, "b:1": 0} and slots[-1] == {"a:1": 0, "b:1": 1}
    assert all(sum(s.values()) == 1 for s in slots)
    assert all(w.outstanding == 0 for w in pool._workers.values())  # released at the end


def test_without_migration_nothing_is_held_and_a_dead_worker_s_failure_stands() -> None:
    script = [started(), content("a", token_ids=(1,)), content("b", token_ids=()), progress(), DIED]
    pool, clients = pool_of({"a:1": [script], "b:1": []})
    events, error, metrics = read_all(pool, request(), max_migrations=0)
    assert isinstance(error, ServiceUnavailableError)
    # "b" waits for no ids: it comes before the progress event that followed it.
    assert [e.WhichOneof("event") for e in events] == ["started", "content", "content", "progress"]
    assert metrics.outcomes == [] and clients["b:1"].requests == []
