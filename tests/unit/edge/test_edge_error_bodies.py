"""Error bodies never carry internal detail: forced internal failures, and what callers see.

Each failure below plants a marker (a secret-looking string, an address) in
the exception or the worker's status message; the answer must be the generic
OpenAI error, with no marker, traceback, exception repr or address in it. The
same checks on real processes are in tests/integration/test_edge_security.py.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any, cast

import grpc
import httpx
import pytest
from edge_fakes import (
    CHAT_BODY,
    Abort,
    FakeWorker,
    content,
    dead_address,
    run,
    running_edge,
    running_worker,
    started,
)

from edge.app import create_app
from edge.errors import GENERIC_INTERNAL_MESSAGE
from edge.settings import Settings
from edge.surfaces.chat import translate
from edge.workers.pool import Placement
from edge.workers.worker import Worker
from sluice.client import WorkerClient
from sluice.status import ErrorDetails
from sluice.v1 import worker_pb2

SECRET = "s3cret-internal-marker"
ADDRESS = "10.9.8.7:50051"
LEAKS = (SECRET, ADDRESS, "Traceback", "RuntimeError", "KeyError", "grpc", "StatusCode", 'File "', ".py")


def assert_clean(text: str) -> None:
    """No internal detail in a response body (plain JSON or SSE)."""
    for leak in LEAKS:
        assert leak not in text, f"{leak!r} leaked into {text!r}"


def error_of(text: str) -> dict[str, Any]:
    """The error object of a JSON error body or of an SSE stream's ``event: error`` frame."""
    if text.startswith("{"):
        error: dict[str, Any] = json.loads(text)["error"]
        return error
    frames = text.split("\n\n")
    (frame,) = [f for f in frames if f.startswith("event: error\n")]
    error = json.loads(frame.split("data: ", 1)[1])["error"]
    return error


class _BrokenCall:
    """A gRPC call whose first event arrives and whose next read fails with an unexpected exception."""

    def __init__(self) -> None:
        self.reads = 0

    async def read(self) -> worker_pb2.GenerateResponse:
        self.reads += 1
        if self.reads == 1:
            return worker_pb2.GenerateResponse(started=worker_pb2.Started(model="m", worker_id="w", n=1))
        raise RuntimeError(f"{SECRET} lost the channel to {ADDRESS}")

    def cancel(self) -> bool:
        return False


class _BrokenPool:
    """A pool that fails in ways no edge code expects (the parts of it a worker call uses)."""

    connect_timeout_s = 5.0

    def __init__(self, stream_first: bool) -> None:
        self.stream_first = stream_first

    async def place(self, request: Any) -> Placement:
        if self.stream_first:
            return Placement([Worker(ADDRESS, cast(WorkerClient, None), static=True)], [])
        raise RuntimeError(f"{SECRET}: bad channel to {ADDRESS}")

    def dial(self, *args: Any) -> _BrokenCall:
        return _BrokenCall()

    def accepted(self, *args: Any) -> None:
        pass

    def release(self, worker: Worker) -> None:
        pass

    def note_call_success(self, worker: Worker) -> None:
        pass

    async def list_models(self) -> Any:
        raise KeyError(f"{SECRET} {ADDRESS}")

    async def health(self) -> list[Any]:
        return []

    def open(self) -> None:
        pass

    async def close(self) -> None:
        pass


@pytest.mark.parametrize("stream", [False, True])
def test_unexpected_exceptions_in_a_fake_pool_give_generic_bodies(
    stream: bool, caplog: pytest.LogCaptureFixture
) -> None:
    app = create_app(Settings(workers=(ADDRESS,)))
    app.sluice.pool = _BrokenPool(stream_first=False)  # type: ignore[assignment]

    async def body() -> None:
        client = app.test_client()
        response = await client.post("/v1/chat/completions", json={**CHAT_BODY, "stream": stream})
        text = await response.get_data(as_text=True)
        assert response.status_code == 500 and response.content_type == "application/json"
        assert_clean(text)
        assert error_of(text) == {
            "message": GENERIC_INTERNAL_MESSAGE,
            "type": "api_error",
            "param": None,
            "code": "internal_error",
        }
        models = await client.get("/v1/models")
        assert models.status_code == 500
        assert_clean(await models.get_data(as_text=True))

    run(body())
    assert SECRET in caplog.text  # the detail goes to the log, for operators


def test_a_stream_that_fails_mid_way_ends_with_a_generic_error_event() -> None:
    app = create_app(Settings(workers=(ADDRESS,)))
    app.sluice.pool = _BrokenPool(stream_first=True)  # type: ignore[assignment]

    async def body() -> None:
        response = await app.test_client().post("/v1/chat/completions", json={**CHAT_BODY, "stream": True})
        text = await response.get_data(as_text=True)
        assert response.status_code == 200 and text.endswith("data: [DONE]\n\n")
        assert_clean(text)
        assert error_of(text)["message"] == GENERIC_INTERNAL_MESSAGE

    run(body())


def test_a_bug_in_translation_mid_stream_is_reported_generically(monkeypatch: pytest.MonkeyPatch) -> None:
    def explode(
        self: translate.ChatTranslator, call: int, event: worker_pb2.GenerateResponse
    ) -> list[dict[str, Any]]:
        if event.WhichOneof("event") == "content":
            raise KeyError(f"{SECRET} at {ADDRESS}")
        return []

    monkeypatch.setattr(translate.ChatTranslator, "on_event", explode)
    fake = FakeWorker(script=[started(), content("x")])

    async def body() -> None:
        async with running_worker(fake) as address, running_edge([address]) as base, httpx.AsyncClient() as c:
            text = (await c.post(f"{base}/v1/chat/completions", json={**CHAT_BODY, "stream": True})).text
            assert_clean(text)
            assert error_of(text)["code"] == "internal_error"

    run(body())


class _RawAbortWorker(FakeWorker):
    """Ends Generate with a plain gRPC status (no Sluice details), as a proxy, a library or
    the transport would, optionally after a first event and a delta."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    after_start: bool = False

    async def Generate(  # gRPC method name
        self, request: worker_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.GenerateResponse]:
        self.calls_started += 1
        if self.after_start:
            yield started()
            yield content("x")
        await context.abort(self.code, f"{SECRET} via {ADDRESS}: {RuntimeError('x')!r}")


@pytest.mark.parametrize(
    ("code", "status"),
    [
        (grpc.StatusCode.INTERNAL, 500),
        (grpc.StatusCode.UNKNOWN, 500),
        (grpc.StatusCode.DATA_LOSS, 500),
        (grpc.StatusCode.UNAVAILABLE, 503),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
        (grpc.StatusCode.DEADLINE_EXCEEDED, 504),
    ],
)
def test_worker_statuses_without_sluice_details_are_not_passed_through(
    code: grpc.StatusCode, status: int
) -> None:
    """A status message the worker did not author for callers (a transport or library
    message) can name addresses; the caller gets generic text, before and during a stream."""
    before, during = _RawAbortWorker(), _RawAbortWorker()
    before.code = during.code = code
    during.after_start = True

    async def body() -> None:
        async with (
            running_worker(before) as first,
            running_worker(during) as second,
            running_edge([first]) as base_before,
            running_edge([second]) as base_during,
            httpx.AsyncClient() as client,
        ):
            response = await client.post(f"{base_before}/v1/chat/completions", json=CHAT_BODY)
            assert response.status_code == status
            assert_clean(response.text)
            stream = await client.post(
                f"{base_during}/v1/chat/completions", json={**CHAT_BODY, "stream": True}
            )
            assert stream.status_code == 200 and "event: error" in stream.text
            assert_clean(stream.text)

    run(body())


def test_worker_authored_internal_messages_are_not_passed_through() -> None:
    """Even a Sluice-authored INTERNAL status (e.g. a model failure's message) stays in the logs."""
    fake = FakeWorker(script=[Abort(ErrorDetails(grpc.StatusCode.INTERNAL, f"{SECRET} {ADDRESS}", "boom"))])

    async def body() -> None:
        async with running_worker(fake) as address, running_edge([address]) as base, httpx.AsyncClient() as c:
            response = await c.post(f"{base}/v1/chat/completions", json=CHAT_BODY)
            assert response.status_code == 500
            assert_clean(response.text)
            assert error_of(response.text)["message"] == GENERIC_INTERNAL_MESSAGE

    run(body())


def test_an_unreachable_worker_address_is_not_named_to_the_caller() -> None:
    async def body() -> None:
        dead = dead_address()
        async with running_edge([dead], worker_connect_timeout_s=2.0) as base, httpx.AsyncClient() as client:
            for path, payload in (("/v1/chat/completions", CHAT_BODY), ("/v1/completions", None)):
                body = payload or {"model": "m", "prompt": "x"}
                response = await client.post(f"{base}{path}", json=body, timeout=15)
                assert response.status_code == 503
                assert dead not in response.text and dead.split(":")[1] not in response.text
                assert_clean(response.text)
            models = await client.get(f"{base}/v1/models", timeout=15)
            assert models.status_code == 503 and dead not in models.text

    run(body(), timeout=40)
