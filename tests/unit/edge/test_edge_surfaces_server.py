"""The Responses, Anthropic Messages and native surfaces over HTTP, against a scripted worker:
every error path in each surface's own shape, heartbeats, disconnects, keys and concurrency."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import grpc
import httpx
import pytest
from edge_fakes import (
    Abort,
    FakeWorker,
    Hang,
    Sleep,
    content,
    finished,
    run,
    running_edge,
    running_worker,
    started,
    usage,
    wait_for,
)

from sluice.status import ErrorDetails

MODEL = "SmolLM2-135M-Instruct"
HAPPY = [started(), content("Hel"), content("lo"), finished(), usage()]
BODIES: dict[str, dict[str, Any]] = {
    "/v1/responses": {"model": MODEL, "input": "Hi"},
    "/v1/messages": {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]},
    "/api/v1/chat": {"model": MODEL, "input": "Hi"},
}
SURFACES = list(BODIES)


def stream_body(path: str) -> dict[str, Any]:
    return {**BODIES[path], "stream": True}


def events_of(raw: bytes) -> list[tuple[str, Any]]:
    """(event name, decoded data) of each named frame; comments as ("comment", text)."""
    out: list[tuple[str, Any]] = []
    for frame in raw.decode().split("\n\n"):
        if not frame:
            continue
        if frame.startswith(":"):
            out.append(("comment", frame))
            continue
        name_line, data_line = frame.split("\n")
        assert name_line.startswith("event: ") and data_line.startswith("data: "), frame
        data = json.loads(data_line.removeprefix("data: "))
        assert data["type"] == name_line.removeprefix("event: ")
        out.append((data["type"], data))
    return out


def error_of(path: str, body: Any) -> dict[str, Any]:
    """The error object of a plain error answer, checked against the surface's shape."""
    if path == "/v1/messages":
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
        return dict(body["error"])
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return dict(body["error"])


@pytest.mark.parametrize("path", SURFACES)
def test_happy_stream_and_json(path: str) -> None:
    async def body() -> None:
        fake = FakeWorker(script=HAPPY)
        async with (
            running_worker(fake) as address,
            running_edge([address]) as base,
            httpx.AsyncClient() as client,
        ):
            streamed = await client.post(f"{base}{path}", json=stream_body(path))
            whole = await client.post(f"{base}{path}", json=BODIES[path])
        assert streamed.status_code == 200 and streamed.headers["content-type"].startswith(
            "text/event-stream"
        )
        assert "[DONE]" not in streamed.text
        names = [name for name, _ in events_of(streamed.content)]
        last = {
            "/v1/responses": "response.completed",
            "/v1/messages": "message_stop",
            "/api/v1/chat": "chat.end",
        }
        assert names[-1] == last[path]
        assert whole.status_code == 200 and whole.headers["content-type"] == "application/json"
        text = json.dumps(whole.json())
        assert "Hello" in text
        assert streamed.headers["x-sluice-worker-id"] == "worker-a"

    run(body())


@pytest.mark.parametrize("path", SURFACES)
@pytest.mark.parametrize(
    ("details", "status", "anthropic_type"),
    [
        (
            ErrorDetails(grpc.StatusCode.INVALID_ARGUMENT, "bad", "invalid_parameter", "messages"),
            400,
            "invalid_request_error",
        ),
        (
            ErrorDetails(grpc.StatusCode.NOT_FOUND, "no model x", "model_not_found", "model"),
            404,
            "not_found_error",
        ),
        (
            ErrorDetails(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full", "queue_full", None, 3),
            429,
            "rate_limit_error",
        ),
        (ErrorDetails(grpc.StatusCode.UNAVAILABLE, "starting", "starting", None, 2), 503, "overloaded_error"),
        (ErrorDetails(grpc.StatusCode.INTERNAL, "boom /secret"), 500, "api_error"),
    ],
)
def test_pre_stream_worker_errors_in_each_shape(
    path: str, details: ErrorDetails, status: int, anthropic_type: str
) -> None:
    async def body() -> None:
        fake = FakeWorker(script=[Abort(details)])
        async with (
            running_worker(fake) as address,
            running_edge([address]) as base,
            httpx.AsyncClient() as client,
        ):
            response = await client.post(f"{base}{path}", json=stream_body(path))
        assert response.status_code == status
        assert response.headers["content-type"] == "application/json"
        error = error_of(path, response.json())
        assert "/secret" not in error["message"]
        if path == "/v1/messages":
            assert error["type"] == anthropic_type
        elif path == "/api/v1/chat" and status == 404:
            assert error["type"] == "model_not_found"
        if status in (429, 503):
            assert int(response.headers["retry-after"]) >= 1

    run(body())


@pytest.mark.parametrize("path", SURFACES)
def test_validation_errors_name_the_field_in_each_shape(path: str) -> None:
    async def body() -> None:
        async with (
            running_worker(FakeWorker(script=HAPPY)) as address,
            running_edge([address]) as base,
            httpx.AsyncClient() as client,
        ):
            response = await client.post(f"{base}{path}", json={**BODIES[path], "model": 5})
            not_json = await client.post(
                f"{base}{path}", content=b"[1]", headers={"content-type": "application/json"}
            )
        assert response.status_code == 400
        error = error_of(path, response.json())
        assert "'model'" in error["message"]
        if path != "/v1/messages":
            assert error["param"] == "model"
        assert not_json.status_code == 422
        error_of(path, not_json.json())

    run(body())


@pytest.mark.parametrize("path", SURFACES)
def test_mid_stream_failure_in_each_shape(path: str) -> None:
    details = ErrorDetails(grpc.StatusCode.INTERNAL, "model exploded at /secret/path")

    async def body() -> None:
        fake = FakeWorker(script=[started(), content("Hel"), Abort(details)])
        async with (
            running_worker(fake) as address,
            running_edge([address]) as base,
            httpx.AsyncClient() as client,
        ):
            response = await client.post(f"{base}{path}", json=stream_body(path))
        assert response.status_code == 200 and "/secret" not in response.text
        events = events_of(response.content)
        names = [name for name, _ in events]
        if path == "/v1/responses":
            assert names[-2:] == ["error", "response.failed"]
            assert events[-2][1]["code"] == "internal_error"
            assert events[-1][1]["response"]["status"] == "failed"
        elif path == "/v1/messages":
            assert names[-1] == "error" and "message_stop" not in names
            assert events[-1][1]["error"]["type"] == "api_error"
        else:
            assert names[-2:] == ["error", "chat.end"]
            assert events[-2][1]["error"]["type"] == "internal_error"
            assert events[-1][1]["result"]["output"] == [{"type": "message", "content": "Hel"}]

    run(body())


@pytest.mark.parametrize("path", SURFACES)
def test_idle_timeout_mid_stream_in_each_shape(path: str) -> None:
    async def body() -> None:
        fake = FakeWorker(script=[started(), content("Hel"), Hang()])
        async with (
            running_worker(fake) as address,
            running_edge([address]) as base,
            httpx.AsyncClient() as client,
        ):
            response = await client.post(
                f"{base}{path}", json=stream_body(path), headers={"X-Sluice-Idle-Timeout": "0.3"}
            )
            await asyncio.wait_for(fake.cancelled.wait(), 5)
        events = dict(events_of(response.content))
        error = events["error"]
        if path == "/v1/responses":
            assert error["code"] == "stream_idle_timeout"
        elif path == "/v1/messages":
            assert error["error"]["type"] == "timeout_error"
        else:
            assert error["error"]["code"] == "stream_idle_timeout"

    run(body())


@pytest.mark.parametrize(
    ("path", "beat"), [("/v1/messages", "ping"), ("/v1/responses", "comment"), ("/api/v1/chat", "comment")]
)
def test_heartbeats_as_each_protocol_allows(path: str, beat: str) -> None:
    async def body() -> None:
        fake = FakeWorker(script=[started(), Sleep(0.3), content("x"), finished(), usage()])
        async with (
            running_worker(fake) as address,
            running_edge([address], heartbeat_interval_s=0.05) as base,
            httpx.AsyncClient() as client,
        ):
            response = await client.post(f"{base}{path}", json=stream_body(path))
        names = [name for name, _ in events_of(response.content)]
        assert names.count(beat) >= 3

    run(body())


@pytest.mark.parametrize("path", SURFACES)
def test_client_disconnect_cancels_the_worker_call(path: str) -> None:
    async def body() -> None:
        fake = FakeWorker(script=[started(), content("Hel"), Hang()])
        async with (
            running_worker(fake) as address,
            running_edge([address]) as base,
            httpx.AsyncClient() as client,
        ):
            async with client.stream("POST", f"{base}{path}", json=stream_body(path)) as response:
                seen = b""
                async for piece in response.aiter_raw():
                    seen += piece
                    if b'"Hel"' in seen:
                        break
            await asyncio.wait_for(fake.cancelled.wait(), 5)

    run(body())


def test_api_keys_guard_every_surface_and_x_api_key_counts() -> None:
    async def body() -> None:
        async with (
            running_worker(FakeWorker(script=HAPPY)) as address,
            running_edge([address], api_keys=("k1",)) as base,
            httpx.AsyncClient() as client,
        ):
            for path in SURFACES:
                refused = await client.post(f"{base}{path}", json=BODIES[path])
                assert refused.status_code == 401, path
                error = error_of(path, refused.json())
                if path == "/v1/messages":
                    assert error["type"] == "authentication_error"
                wrong = await client.post(f"{base}{path}", json=BODIES[path], headers={"x-api-key": "k2"})
                assert wrong.status_code == 401
                for headers in ({"x-api-key": "k1"}, {"Authorization": "Bearer k1"}):
                    accepted = await client.post(f"{base}{path}", json=BODIES[path], headers=headers)
                    assert accepted.status_code == 200, (path, accepted.text)
            models = await client.get(f"{base}/api/v1/models")
            assert models.status_code == 401

    run(body())


def test_per_key_concurrency_counts_every_surface() -> None:
    async def body() -> None:
        fake = FakeWorker(script=[started(), content("Hel"), Hang()])
        async with (
            running_worker(fake) as address,
            running_edge([address], max_concurrent_per_key=1) as base,
            httpx.AsyncClient() as client,
            client.stream("POST", f"{base}/v1/messages", json=stream_body("/v1/messages")) as held,
        ):
            # Keep the iterator: a dropped one is finalized, which closes the stream.
            pieces = held.aiter_raw()
            seen = b""
            while b"Hel" not in seen:
                seen += await anext(pieces)
            for path in SURFACES:
                refused = await client.post(f"{base}{path}", json=BODIES[path])
                assert refused.status_code == 429, path
                error_of(path, refused.json())

    run(body())


def test_metrics_count_each_surface_by_route() -> None:
    async def body() -> None:
        async with (
            running_worker(FakeWorker(script=HAPPY)) as address,
            running_edge([address]) as base,
            httpx.AsyncClient() as client,
        ):
            for path in SURFACES:
                await client.post(f"{base}{path}", json=stream_body(path))

            async def counted() -> bool:
                text = (await client.get(f"{base}/metrics")).text
                return all(f'route="{path}"' in text for path in SURFACES)

            await wait_for(counted)

    run(body())


def test_native_models_listing() -> None:
    async def body() -> None:
        async with (
            running_worker(FakeWorker(script=HAPPY)) as address,
            running_edge([address]) as base,
            httpx.AsyncClient() as client,
        ):
            listing = (await client.get(f"{base}/api/v1/models")).json()
        assert listing["models"][0]["key"] == MODEL
        assert listing["models"][0]["loaded_instances"] == [{"id": MODEL}]

    run(body())


@pytest.mark.parametrize("path", SURFACES)
def test_deadline_before_the_first_event_is_a_504_in_each_shape(path: str) -> None:
    async def body() -> None:
        fake = FakeWorker(script=[Hang()])
        async with (
            running_worker(fake) as address,
            running_edge([address]) as base,
            httpx.AsyncClient() as client,
        ):
            response = await client.post(
                f"{base}{path}", json=stream_body(path), headers={"X-Sluice-Timeout": "0.3"}
            )
            bad_header = await client.post(
                f"{base}{path}", json=stream_body(path), headers={"X-Sluice-Timeout": "soon"}
            )
        assert response.status_code == 504
        error = error_of(path, response.json())
        if path == "/v1/messages":
            assert error["type"] == "timeout_error"
        else:
            assert error["code"] == "timeout"
        assert bad_header.status_code == 400
        error_of(path, bad_header.json())

    run(body())
