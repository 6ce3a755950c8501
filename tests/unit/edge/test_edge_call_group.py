"""A response's calls read as one stream (edge/workers/call_group.py ``CallGroup.events``), with fake
calls: order, the bound on what is read ahead of the reader, failures and cancellation."""

from __future__ import annotations

import asyncio

import pytest

from edge.errors import ServiceUnavailableError
from edge.workers.call import WorkerCall, _Leg
from edge.workers.call_group import CallGroup
from edge.workers.migration import MigrationPolicy
from sluice.v1 import worker_pb2
from tests.unit.edge.edge_fakes import content, run
from tests.unit.edge.test_edge_stream_pump import END, FakeStream


def texts(events: list[tuple[int, worker_pb2.GenerateResponse]]) -> list[tuple[int, str]]:
    return [(i, e.content.text) for i, e in events if e.WhichOneof("event") == "content"]


def test_every_call_s_events_in_call_order_tagged_with_the_call() -> None:
    async def body() -> None:
        calls = [FakeStream(), FakeStream()]
        calls[0].put(content("a"), content("b"), END)
        calls[1].put(content("c"), END)
        events = [item async for item in CallGroup(calls).events()]
        assert sorted(i for i, e in events if e.WhichOneof("event") == "started") == [0, 1]
        got = texts(events)
        assert [t for i, t in got if i == 0] == ["a", "b"] and [t for i, t in got if i == 1] == ["c"]
        assert all(call.cancelled for call in calls)  # ended: cancel is a no-op, and always called

    run(body())


def test_a_reader_that_stops_taking_events_stops_every_call_s_reads() -> None:
    async def body() -> None:
        calls = [FakeStream(), FakeStream()]
        for call in calls:
            call.put(*(content("x") for _ in range(50)))
        events = CallGroup(calls).events()
        await anext(events)
        for _ in range(20):  # the calls' readers run as far as they may
            await asyncio.sleep(0)
        # Read and not taken: one event per call in the group's queue, one more waiting in each
        # call's reader (FakeStream does not count its `started`); flow control holds the rest.
        assert sum(call.reads for call in calls) <= 2 * len(calls), [call.reads for call in calls]
        await events.aclose()
        assert all(call.cancelled for call in calls)

    run(body())


def test_a_failure_follows_the_events_read_before_it_and_cancels_every_call() -> None:
    async def body() -> None:
        calls = [FakeStream(), FakeStream()]
        calls[0].put(content("a"), ServiceUnavailableError("worker gone"))
        calls[1].put(content("b"))  # then waits: the failure must not wait for it
        seen: list[tuple[int, worker_pb2.GenerateResponse]] = []
        with pytest.raises(ServiceUnavailableError, match="worker gone"):
            async for item in CallGroup(calls).events():
                seen.append(item)
        assert (0, "a") in texts(seen)
        assert all(call.cancelled for call in calls)

    run(body())


def test_a_one_call_group_hands_events_taken_as_they_arrive_as_its_reader_would_get_them() -> None:
    """``take_inline``: what the call's leg takes goes to ``take`` tracked for migration (a delta
    waits for its ids, then goes with them), seen by the observer; nothing is taken while ``ready``
    says no; what raises on the way goes to ``failed``, the event counted as taken."""
    started = worker_pb2.GenerateResponse(started=worker_pb2.Started(resumable=True))
    leg = _Leg(call=None, worker=None, first=started, pool=None)  # type: ignore[arg-type]
    call = WorkerCall(
        None,  # type: ignore[arg-type]
        leg,
        worker_pb2.GenerateRequest(),
        request_id="r",
        deadline=0.0,
        metadata=(),
        migration=MigrationPolicy(1),
    )
    call._delivered.track(started, False)  # the iteration's first event: resumable from here
    group, taken, observed, failures = CallGroup([call]), [], [], []
    group.observer = lambda index, event: observed.append(event.content.text)
    ready = True
    group.take_inline(lambda: ready, lambda i, e: taken.append((i, e.content.text)), failures.append)
    bare, with_ids = content("held"), content("ids")
    with_ids.content.token_ids.append(7)
    assert call._take(bare) and taken == []  # held until ids come
    assert call._take(with_ids) and taken == [(0, "held"), (0, "ids")] and observed == ["held", "ids"]
    ready = False
    assert not call._take(content("later")) and len(taken) == 2
    ready = True
    group.observer = lambda index, event: 1 / 0
    assert call._take(with_ids) and isinstance(failures[0], ZeroDivisionError)
    assert len(taken) == 2
