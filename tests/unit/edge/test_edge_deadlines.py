"""Per-request time limits: header parsing, the event guard, and both over HTTP against a fake worker."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any

import httpx
import pytest
from edge_fakes import (
    CHAT_BODY,
    FakeWorker,
    Hang,
    ScriptedSource,
    Sleep,
    Step,
    content,
    finished,
    run,
    running_edge,
    running_worker,
    started,
    usage,
)

from edge.deadlines import (
    IDLE_TIMEOUT_HEADER,
    TIMEOUT_HEADER,
    EventGuard,
    TimeLimits,
    parse_seconds_header,
    request_limits,
)
from edge.errors import (
    DeadlineExceededError,
    InvalidRequestError,
    ServerShuttingDownError,
    StreamIdleTimeoutError,
)
from edge.settings import Settings
from sluice.v1 import worker_pb2

STREAM_BODY = {**CHAT_BODY, "stream": True}


def progress(stage: int = worker_pb2.Progress.QUEUED) -> worker_pb2.GenerateResponse:
    return worker_pb2.GenerateResponse(progress=worker_pb2.Progress(stage=stage))  # type: ignore[arg-type]


def frames_of(raw: bytes) -> list[str]:
    text = raw.decode()
    assert text.endswith("\n\n"), "every frame is terminated"
    return text[:-2].split("\n\n")


def error_event(frames: list[str]) -> dict[str, Any]:
    """The ``event: error`` frame's error object; asserts the stream then ends with [DONE]."""
    assert frames[-1] == "data: [DONE]"
    event_line, data_line = frames[-2].split("\n")
    assert event_line == "event: error"
    error: dict[str, Any] = json.loads(data_line.removeprefix("data: "))["error"]
    return error


# ------------------------------------------------------------------ headers


def test_header_absent_gives_the_default_and_values_are_clamped_to_the_cap() -> None:
    assert parse_seconds_header(TIMEOUT_HEADER, None, 600.0, 3600.0) == 600.0
    assert parse_seconds_header(TIMEOUT_HEADER, "30", 600.0, 3600.0) == 30.0
    assert parse_seconds_header(TIMEOUT_HEADER, " 2.5 ", 600.0, 3600.0) == 2.5
    assert parse_seconds_header(TIMEOUT_HEADER, "7200", 600.0, 3600.0) == 3600.0
    settings = Settings(workers=("h:1",), max_idle_timeout_s=200.0)
    assert request_limits(None, "1000", settings) == TimeLimits(total_s=600.0, idle_s=200.0)


@pytest.mark.parametrize(
    "value", ["", " ", "abc", "-1", "0", "0.0", "1e3", "inf", "nan", "5s", "+5", "1.", ".5"]
)
def test_malformed_header_is_a_400_naming_it(value: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        parse_seconds_header(IDLE_TIMEOUT_HEADER, value, 120.0, 600.0)
    assert caught.value.param == IDLE_TIMEOUT_HEADER and caught.value.http_status == 400
    assert IDLE_TIMEOUT_HEADER in caught.value.message


def test_settings_reject_a_default_above_its_cap() -> None:
    with pytest.raises(ValueError, match="idle_timeout_s"):
        Settings(workers=("h:1",), idle_timeout_s=700.0)
    with pytest.raises(ValueError, match="request_timeout_s"):
        Settings(workers=("h:1",), request_timeout_s=10.0, max_request_timeout_s=5.0)


def test_lifecycle_flags_and_env() -> None:
    settings = Settings.from_args(
        ["--workers", "h:1", "--idle-timeout", "5", "--max-idle-timeout", "10", "--drain-delay", "0"],
        env={"SLUICE_EDGE_WRITE_TIMEOUT": "2.5", "SLUICE_EDGE_MAX_REQUEST_TIMEOUT": "900"},
    )
    assert (settings.idle_timeout_s, settings.max_idle_timeout_s, settings.drain_delay_s) == (5.0, 10.0, 0.0)
    assert (settings.write_timeout_s, settings.max_request_timeout_s) == (2.5, 900.0)
    defaults = Settings(workers=("h:1",))
    assert (defaults.idle_timeout_s, defaults.write_timeout_s, defaults.drain_delay_s) == (120.0, 30.0, 5.0)


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--drain-delay", "-1"], "--drain-delay"),
        (["--write-timeout", "0"], "--write-timeout"),
        (["--idle-timeout", "nan"], "--idle-timeout"),
        (["--idle-timeout", "30", "--max-idle-timeout", "20"], "--idle-timeout"),
    ],
)
def test_bad_lifecycle_flags_name_the_flag(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        Settings.from_args(["--workers", "h:1", *argv], env={})
    assert flag in capsys.readouterr().err


# ------------------------------------------------------------------ the guard


async def drain_guard(
    guard: EventGuard, source: ScriptedSource[str]
) -> tuple[list[str], BaseException | None]:
    got: list[str] = []
    try:
        async for event in guard.watch(source.items()):
            got.append(event)
    except Exception as error:
        return got, error
    return got, None


def test_events_within_the_limits_pass_untouched() -> None:
    async def body() -> None:
        source = ScriptedSource(["a", 0.05, "b", 0.05, "c"])
        got, error = await drain_guard(EventGuard(TimeLimits(total_s=5.0, idle_s=0.5)), source)
        assert (got, error) == (["a", "b", "c"], None) and source.closed and not source.cancelled

    run(body())


def test_idle_timeout_restarts_on_every_event_and_cuts_a_silence() -> None:
    async def body() -> None:
        # Ten gaps of 0.05 s (0.5 s in all) under a 0.2 s idle timeout, then silence.
        source = ScriptedSource([*(x for _ in range(10) for x in ("e", 0.05)), "last", 30.0, "never"])
        started_at = time.monotonic()
        got, error = await drain_guard(EventGuard(TimeLimits(total_s=30.0, idle_s=0.2)), source)
        elapsed = time.monotonic() - started_at
        assert got[-1] == "last" and len(got) == 11
        assert isinstance(error, StreamIdleTimeoutError) and error.type == "stream_idle_timeout"
        assert source.cancelled and source.closed  # the pending read was cancelled before the error
        assert 0.6 < elapsed < 5.0, elapsed

    run(body())


def test_total_deadline_cuts_a_stream_that_keeps_talking() -> None:
    async def body() -> None:
        source = ScriptedSource([x for _ in range(1000) for x in ("e", 0.02)])
        got, error = await drain_guard(EventGuard(TimeLimits(total_s=0.3, idle_s=10.0)), source)
        assert isinstance(error, DeadlineExceededError) and error.type == "timeout_error"
        assert 3 < len(got) < 100 and source.cancelled

    run(body())


def test_stop_ends_a_waiting_read_at_once_and_a_busy_consumer_at_its_next_read() -> None:
    async def body() -> None:
        waiting = EventGuard(TimeLimits(total_s=30.0, idle_s=30.0))
        source = ScriptedSource(["a", 30.0])
        task = asyncio.create_task(drain_guard(waiting, source))
        await asyncio.sleep(0.05)
        waiting.stop(ServerShuttingDownError("bye"))
        got, error = await asyncio.wait_for(task, 2.0)
        assert got == ["a"] and isinstance(error, ServerShuttingDownError) and source.cancelled

        busy = EventGuard(TimeLimits(total_s=30.0, idle_s=30.0))
        events = busy.watch(ScriptedSource(["a", "b"]).items())
        assert await anext(events) == "a"
        busy.stop(ServerShuttingDownError("bye"))  # the consumer is between reads
        with pytest.raises(ServerShuttingDownError):
            await anext(events)

    run(body())


# ------------------------------------------------------------------ over HTTP


async def post(base: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> httpx.Response:
    async with httpx.AsyncClient(timeout=20) as client:
        return await client.post(f"{base}/v1/chat/completions", json=body, headers=headers or {})


def test_idle_timeout_ends_a_stream_with_an_error_event_and_cancels_the_call() -> None:
    fake = FakeWorker(script=[started(), content("Hel"), Hang()])

    async def body() -> None:
        async with running_worker(fake) as address, running_edge([address], heartbeat_interval_s=0.1) as base:
            response = await post(base, STREAM_BODY, {IDLE_TIMEOUT_HEADER: "0.4"})
            assert response.status_code == 200
            frames = frames_of(response.content)
            assert '"Hel"' in frames[1] and ": heartbeat" in frames  # heartbeats went out meanwhile
            error = error_event(frames)
            assert (error["type"], error["code"]) == ("stream_idle_timeout", "stream_idle_timeout")
            await asyncio.wait_for(fake.cancelled.wait(), 5)
            assert fake.requests[0].stream_progress  # the edge asks for progress events

    run(body())


def test_total_deadline_ends_a_stream_with_timeout_error() -> None:
    chatter: list[Step] = [started(), *(x for _ in range(500) for x in (content("x"), Sleep(0.02)))]
    fake = FakeWorker(script=chatter)

    async def body() -> None:
        async with running_worker(fake) as address, running_edge([address]) as base:
            began = time.monotonic()
            response = await post(base, STREAM_BODY, {TIMEOUT_HEADER: "0.5"})
            elapsed = time.monotonic() - began
            error = error_event(frames_of(response.content))
            assert error["type"] == "timeout_error" and "0.5 s" in error["message"]
            assert elapsed < 5.0, elapsed
            await asyncio.wait_for(fake.cancelled.wait(), 5)

    run(body())


def test_progress_events_keep_a_queued_stream_alive_without_data_frames() -> None:
    # 1.2 s of worker "silence" made of progress events every 0.15 s, under a 0.4 s idle timeout.
    waiting: list[Step] = [x for _ in range(8) for x in (Sleep(0.15), progress())]
    fake = FakeWorker(
        script=[
            started(),
            *waiting,
            progress(worker_pb2.Progress.PROMPT_PROCESSING),
            content("ok"),
            finished(),
            usage(),
        ]
    )

    async def body() -> None:
        async with running_worker(fake) as address, running_edge([address], heartbeat_interval_s=0.1) as base:
            response = await post(base, STREAM_BODY, {IDLE_TIMEOUT_HEADER: "0.4"})
            frames = frames_of(response.content)
            data = [json.loads(f.removeprefix("data: ")) for f in frames if f.startswith("data: {")]
            # role, "ok", finish: progress produced no data frame, and nothing failed.
            assert [c["choices"][0]["delta"] for c in data] == [
                {"role": "assistant", "content": ""},
                {"content": "ok"},
                {},
            ]
            assert "event: error" not in response.text and frames[-1] == "data: [DONE]"
            assert frames.count(": heartbeat") >= 5  # the silence still had heartbeats

    run(body())


def test_server_cap_clamps_a_larger_header() -> None:
    fake = FakeWorker(script=[started(), Hang()])

    async def body() -> None:
        async with (
            running_worker(fake) as address,
            running_edge([address], idle_timeout_s=0.2, max_idle_timeout_s=0.3) as base,
        ):
            began = time.monotonic()
            response = await post(base, STREAM_BODY, {IDLE_TIMEOUT_HEADER: "100"})
            elapsed = time.monotonic() - began
            assert error_event(frames_of(response.content))["type"] == "stream_idle_timeout"
            assert elapsed < 5.0, elapsed

    run(body())


def test_non_streaming_limits_are_504_json() -> None:
    fake = FakeWorker(
        script_for=lambda request: (
            [started(), Hang()]
            if request.user == "hang"
            else [started(), *(x for _ in range(500) for x in (content("x"), Sleep(0.02)))]
        )
    )

    async def body() -> None:
        async with running_worker(fake) as address, running_edge([address]) as base:
            idle = await post(base, {**CHAT_BODY, "user": "hang"}, {IDLE_TIMEOUT_HEADER: "0.3"})
            assert idle.status_code == 504 and idle.headers["content-type"] == "application/json"
            assert idle.json()["error"]["type"] == "stream_idle_timeout"
            total = await post(base, CHAT_BODY, {TIMEOUT_HEADER: "0.4"})
            assert total.status_code == 504 and total.json()["error"]["type"] == "timeout_error"
            # The cancellations reach the fake worker over real gRPC: allow for a loaded machine.
            for _ in range(100):
                if fake.calls_cancelled == 2:
                    break
                await asyncio.sleep(0.05)
            assert fake.calls_cancelled == 2

    run(body())


def test_malformed_timeout_header_is_a_400_before_any_call() -> None:
    fake = FakeWorker(script=[started(), content("x"), finished(), usage()])

    async def body() -> None:
        async with running_worker(fake) as address, running_edge([address]) as base:
            response = await post(base, STREAM_BODY, {TIMEOUT_HEADER: "soon"})
            assert response.status_code == 400 and "data:" not in response.text
            error = response.json()["error"]
            assert error["param"] == TIMEOUT_HEADER and TIMEOUT_HEADER in error["message"]
            assert fake.calls_started == 0

    run(body())


def test_deadline_before_the_worker_accepts_is_a_504_not_a_stream() -> None:
    fake = FakeWorker(script=[Sleep(5.0), started(), content("late"), finished(), usage()])

    async def body() -> None:
        async with running_worker(fake) as address, running_edge([address]) as base:
            began = time.monotonic()
            response = await post(base, STREAM_BODY, {TIMEOUT_HEADER: "0.3"})
            assert time.monotonic() - began < 3.0
            assert response.status_code == 504 and response.headers["content-type"] == "application/json"
            error = response.json()["error"]
            assert error["type"] == "timeout_error" and "0.3 s" in error["message"]
            await asyncio.wait_for(fake.cancelled.wait(), 5)

    run(body())


def test_open_calls_honours_a_cancellation_swallowed_while_the_calls_opened(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Python 3.11's asyncio.wait_for (used while a call waits for its first event) returns the
    # result instead of raising when the task is cancelled just as that result arrives. Without
    # a check, a client gone at that moment would leave its calls running to their end.
    from edge.app import create_app
    from edge.surfaces import generation
    from edge.workers.call_group import CallGroup

    class OpenedGroup:
        cancelled = False

        def cancel(self) -> None:
            self.cancelled = True

    group = OpenedGroup()

    async def open_swallowing_cancel(*_args: Any, **_kwargs: Any) -> OpenedGroup:
        task = asyncio.current_task()
        assert task is not None
        task.cancel()  # the client goes away ...
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(0)  # ... and the cancellation is lost on the way, as wait_for does
        return group

    monkeypatch.setattr(CallGroup, "open", open_swallowing_cancel)

    async def body() -> None:
        app = create_app(Settings(workers=("127.0.0.1:1",)))
        async with app.test_request_context("/v1/chat/completions", method="POST"):
            with pytest.raises(asyncio.CancelledError):
                await generation.open_calls([worker_pb2.GenerateRequest()])
        assert group.cancelled

    run(body())
