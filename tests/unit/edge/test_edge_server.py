"""The edge served by hypercorn in-process against fake grpc.aio workers."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import grpc
import httpx
import openai
import pytest
from edge_fakes import (
    CHAT_BODY,
    Abort,
    FakeWorker,
    Hang,
    Sleep,
    content,
    dead_address,
    finished,
    run,
    running_edge,
    running_worker,
    started,
    usage,
    wait_for,
)

from sluice.status import ErrorDetails

STREAM_BODY = {**CHAT_BODY, "stream": True, "stream_options": {"include_usage": True}}
HAPPY = [started(), content("Hel"), content("lo"), finished(), usage()]


def split_frames(raw: bytes) -> list[str]:
    """The body as its frames (without the blank-line terminators); every frame must be terminated."""
    text = raw.decode()
    assert text.endswith("\n\n")
    return text[:-2].split("\n\n")


def data_of(frame: str) -> Any:
    assert frame.startswith("data: ") and "\n" not in frame
    return json.loads(frame[len("data: ") :])


def test_stream_shape_byte_for_byte() -> None:
    fake = FakeWorker(script=HAPPY)

    async def body() -> None:
        async with (
            running_worker(fake) as address,
            running_edge([address]) as base,
            httpx.AsyncClient() as client,
        ):
            response = await client.post(
                f"{base}/v1/chat/completions",
                json={**STREAM_BODY, "user": "zoë", "metadata": {"team": "ünï"}},
                headers={"X-Request-ID": "caller-id-1"},
            )
            assert response.status_code == 200
            assert response.headers["content-type"] == "text/event-stream"
            assert response.headers["cache-control"] == "no-cache"
            assert response.headers["x-request-id"] == "caller-id-1"
            assert response.headers["x-sluice-worker-id"] == "worker-a"
            frames = split_frames(response.content)
            assert frames[-1] == "data: [DONE]"
            chunks = [data_of(f) for f in frames[:-1]]
            assert [c["choices"] for c in chunks] == [
                [
                    {
                        "index": 0,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
                [{"index": 0, "delta": {"content": "Hel"}, "logprobs": None, "finish_reason": None}],
                [{"index": 0, "delta": {"content": "lo"}, "logprobs": None, "finish_reason": None}],
                [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}],
                [],
            ]
            assert [c["usage"] for c in chunks[:-1]] == [None] * 4
            assert chunks[-1]["usage"] == {
                "prompt_tokens": 5,
                "completion_tokens": 2,
                "total_tokens": 7,
                "prompt_tokens_details": {"cached_tokens": 0},
                "completion_tokens_details": {"reasoning_tokens": 0},
            }
            assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
            assert len({c["created"] for c in chunks}) == 1
            for chunk in chunks:
                assert chunk["object"] == "chat.completion.chunk"
                assert chunk["model"] == "SmolLM2-135M-Instruct"
                assert chunk["system_fingerprint"] is None and chunk["service_tier"] is None
            # The request id travels once, in the request itself (not again as call metadata).
            assert fake.requests[0].request_id == "caller-id-1" and "x-request-id" not in fake.metadata[0]
            assert fake.requests[0].user == "zoë"
            assert dict(fake.requests[0].metadata) == {"team": "ünï"}
            assert fake.requests[0].request_id == "caller-id-1"

    run(body())


def test_stream_without_include_usage_has_no_usage() -> None:
    async def body() -> None:
        async with running_worker(FakeWorker(script=HAPPY)) as address, running_edge([address]) as base:
            async with httpx.AsyncClient() as client:
                response = await client.post(
                    f"{base}/v1/chat/completions", json={**CHAT_BODY, "stream": True}
                )
            frames = split_frames(response.content)
            chunks = [data_of(f) for f in frames[:-1]]
            assert len(chunks) == 4 and all("usage" not in c for c in chunks)
            assert response.headers["x-request-id"].startswith("req_")

    run(body())


@pytest.mark.parametrize(
    ("details", "status", "param", "retry_after"),
    [
        (
            ErrorDetails(
                grpc.StatusCode.INVALID_ARGUMENT, "bad content", "invalid_parameter", "messages[0].content"
            ),
            400,
            "messages[0].content",
            None,
        ),
        (
            ErrorDetails(grpc.StatusCode.NOT_FOUND, "no model x", "model_not_found", "model"),
            404,
            "model",
            None,
        ),
        (
            ErrorDetails(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full", "queue_full", None, 3),
            429,
            None,
            "3",
        ),
    ],
)
def test_pre_stream_error_is_plain_json(
    details: ErrorDetails, status: int, param: str | None, retry_after: str | None
) -> None:
    async def body() -> None:
        fake = FakeWorker(script=[Abort(details)])
        async with (
            running_worker(fake) as address,
            running_edge([address]) as base,
            httpx.AsyncClient() as client,
        ):
            response = await client.post(f"{base}/v1/chat/completions", json=STREAM_BODY)
            assert response.status_code == status
            assert response.headers["content-type"] == "application/json"
            assert response.headers.get("retry-after") == retry_after
            error = response.json()["error"]
            assert (error["message"], error["param"]) == (details.message, param)
            assert "data:" not in response.text

    run(body())


def test_mid_stream_failure_sends_error_event_then_done() -> None:
    details = ErrorDetails(grpc.StatusCode.INTERNAL, "model exploded at /secret/path")
    fake = FakeWorker(script=[started(), content("Hel"), Abort(details)])

    async def body() -> None:
        async with (
            running_worker(fake) as address,
            running_edge([address]) as base,
            httpx.AsyncClient() as client,
        ):
            response = await client.post(f"{base}/v1/chat/completions", json=STREAM_BODY)
            assert response.status_code == 200
            frames = split_frames(response.content)
            assert data_of(frames[0])["choices"][0]["delta"] == {"role": "assistant", "content": ""}
            assert data_of(frames[1])["choices"][0]["delta"] == {"content": "Hel"}
            event_line, data_line = frames[2].split("\n")
            assert event_line == "event: error"
            error = json.loads(data_line.removeprefix("data: "))["error"]
            assert set(error) == {"message", "type", "code", "param"}
            assert error["type"] == "api_error" and "/secret" not in error["message"]
            assert frames[3:] == ["data: [DONE]"]

    run(body())


def test_client_disconnect_cancels_the_worker_call() -> None:
    fake = FakeWorker(script=[started(), content("Hel"), Hang()])

    async def body() -> None:
        async with (
            running_worker(fake) as address,
            running_edge([address]) as base,
            httpx.AsyncClient() as client,
        ):
            async with client.stream("POST", f"{base}/v1/chat/completions", json=STREAM_BODY) as response:
                seen = b""
                async for piece in response.aiter_raw():
                    seen += piece
                    if b'"Hel"' in seen:
                        break
            # Leaving the block closes the connection mid-stream.
            await asyncio.wait_for(fake.cancelled.wait(), 5)

            async def slot_released() -> bool:
                ready = (await client.get(f"{base}/ready")).json()
                return bool(ready["workers"][0]["outstanding"] == 0)

            await wait_for(slot_released)

    run(body())


def test_heartbeats_while_the_worker_is_silent() -> None:
    fake = FakeWorker(script=[started(), Sleep(0.3), content("x"), finished(), usage()])

    async def body() -> None:
        async with (
            running_worker(fake) as address,
            running_edge([address], heartbeat_interval_s=0.05) as base,
            httpx.AsyncClient() as client,
        ):
            response = await client.post(f"{base}/v1/chat/completions", json=STREAM_BODY)
            frames = split_frames(response.content)
            assert frames[0].startswith("data: ")  # role chunk right after started
            assert frames[1] == ": heartbeat"
            assert sum(f == ": heartbeat" for f in frames) >= 3
            assert frames[-1] == "data: [DONE]"

    run(body())


def test_non_streaming_completion() -> None:
    async def body() -> None:
        async with running_worker(FakeWorker(script=HAPPY)) as address, running_edge([address]) as base:
            async with httpx.AsyncClient() as client:
                response = await client.post(f"{base}/v1/chat/completions", json=CHAT_BODY)
            assert response.status_code == 200
            assert response.headers["content-type"] == "application/json"
            assert response.headers["x-sluice-worker-id"] == "worker-a"
            result = response.json()
            assert result["object"] == "chat.completion"
            assert result["choices"][0]["message"]["content"] == "Hello"
            assert result["choices"][0]["finish_reason"] == "stop"
            assert result["usage"]["total_tokens"] == 7

    run(body())


def test_dead_worker_is_skipped() -> None:
    fake = FakeWorker(script=HAPPY)

    async def body() -> None:
        async with running_worker(fake) as address, running_edge([dead_address(), address]) as base:
            async with httpx.AsyncClient() as client:
                for _ in range(3):
                    response = await client.post(f"{base}/v1/chat/completions", json=CHAT_BODY)
                    assert response.status_code == 200, response.text
                ready = await client.get(f"{base}/ready")
            assert ready.status_code == 200
            assert sorted(w["status"] for w in ready.json()["workers"]) == ["SERVING", "UNREACHABLE"]
        assert fake.calls_started == 3

    run(body())


def test_no_worker_reachable() -> None:
    async def body() -> None:
        async with running_edge([dead_address()]) as base, httpx.AsyncClient() as client:
            response = await client.post(f"{base}/v1/chat/completions", json=STREAM_BODY)
            assert response.status_code == 503
            assert response.headers["retry-after"] == "1"
            assert response.json()["error"]["type"] == "server_error"
            assert "127.0.0.1" not in response.text
            ready = await client.get(f"{base}/ready")
            assert ready.status_code == 503
            assert ready.json()["error"]["type"] == "server_error"
            assert ready.json()["workers"][0]["status"] == "UNREACHABLE"
            assert (await client.get(f"{base}/health")).json() == {"status": "ok"}
            assert (await client.get(f"{base}/v1/models")).status_code == 503

    run(body())


def test_worker_that_never_starts_is_abandoned() -> None:
    fake = FakeWorker(script=[Hang()])

    async def body() -> None:
        async with (
            running_worker(fake) as address,
            running_edge([address], worker_connect_timeout_s=0.2) as base,
            httpx.AsyncClient() as client,
        ):
            response = await client.post(f"{base}/v1/chat/completions", json=CHAT_BODY)
            assert response.status_code == 503
            await asyncio.wait_for(fake.cancelled.wait(), 5)

    run(body())


def test_models_routes_and_http_errors() -> None:
    fake = FakeWorker(models=["SmolLM2-135M-Instruct", "org/model-b"])

    async def body() -> None:
        async with (
            running_worker(fake) as address,
            running_edge([address]) as base,
            httpx.AsyncClient() as client,
        ):
            listing = (await client.get(f"{base}/v1/models")).json()
            assert listing["object"] == "list"
            assert [m["id"] for m in listing["data"]] == ["SmolLM2-135M-Instruct", "org/model-b"]
            one = await client.get(f"{base}/v1/models/org/model-b")
            assert one.json() == {
                "id": "org/model-b",
                "object": "model",
                "created": 1700000000,
                "owned_by": "sluice",
            }
            missing = await client.get(f"{base}/v1/models/nope")
            assert (missing.status_code, missing.json()["error"]["code"]) == (404, "model_not_found")
            unknown = await client.get(f"{base}/v2/whatever")
            assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "invalid_request_error"
            wrong_method = await client.get(f"{base}/v1/chat/completions")
            assert wrong_method.status_code == 405 and "error" in wrong_method.json()
            bad_json = await client.post(
                f"{base}/v1/chat/completions", content=b"{nope", headers={"Content-Type": "application/json"}
            )
            assert (bad_json.status_code, bad_json.json()["error"]["code"]) == (400, "invalid_json")
            form = await client.post(f"{base}/v1/chat/completions", content=b"a=b")
            assert form.status_code == 400 and "Content-Type" in form.json()["error"]["message"]
            invalid = await client.post(f"{base}/v1/chat/completions", json={**STREAM_BODY, "temperature": 9})
            assert invalid.status_code == 400 and invalid.json()["error"]["param"] == "temperature"
            assert fake.calls_started == 0  # nothing invalid reached the worker

    run(body())


def test_body_too_large() -> None:
    async def body() -> None:
        async with running_edge([dead_address()], max_body_bytes=1000) as base, httpx.AsyncClient() as client:
            response = await client.post(
                f"{base}/v1/chat/completions", json={**CHAT_BODY, "user": "x" * 2000}
            )
            assert response.status_code == 413
            assert response.json()["error"]["type"] == "invalid_request_error"

    run(body())


def test_openai_sdk_streams_and_raises_on_error_event() -> None:
    ok = FakeWorker(script=HAPPY)
    broken = FakeWorker(
        script=[started(), content("Hel"), Abort(ErrorDetails(grpc.StatusCode.INTERNAL, "x"))]
    )

    async def body() -> None:
        async with running_worker(ok) as address, running_edge([address]) as base:
            client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
            stream = await client.chat.completions.create(
                model="SmolLM2-135M-Instruct",
                messages=[{"role": "user", "content": "Hi"}],
                stream=True,
                stream_options={"include_usage": True},
            )
            text, usage_seen = "", None
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    text += chunk.choices[0].delta.content
                usage_seen = chunk.usage or usage_seen
            assert text == "Hello"
            assert usage_seen is not None and usage_seen.total_tokens == 7
            completion = await client.chat.completions.create(
                model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "Hi"}]
            )
            assert completion.choices[0].message.content == "Hello"
            await client.close()
        async with running_worker(broken) as address, running_edge([address]) as base:
            client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
            stream = await client.chat.completions.create(
                model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "Hi"}], stream=True
            )
            with pytest.raises(openai.APIError):
                async for _ in stream:
                    pass
            await client.close()

    run(body())


def test_every_answer_has_a_request_id_and_worker_answers_name_the_worker() -> None:
    busy = FakeWorker(
        script=[Abort(ErrorDetails(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full", "queue_full", None, 2))],
        worker_id="worker-busy",
    )

    async def body() -> None:
        async with (
            running_worker(busy) as address,
            running_edge([address], max_body_bytes=2000) as base,
            httpx.AsyncClient() as client,
        ):
            answers = {
                "400": await client.post(f"{base}/v1/chat/completions", json={**CHAT_BODY, "n": 0}),
                "404": await client.get(f"{base}/v1/nothing-here"),
                "405": await client.get(f"{base}/v1/completions"),
                "413": await client.post(
                    f"{base}/v1/chat/completions", json={**CHAT_BODY, "user": "x" * 3000}
                ),
                "422": await client.post(f"{base}/v1/chat/completions", json=[CHAT_BODY]),
                "429": await client.post(f"{base}/v1/chat/completions", json=STREAM_BODY),
            }
            for status, response in answers.items():
                assert str(response.status_code) == status, response.text
                assert response.headers["content-type"] == "application/json"
                assert response.headers["x-request-id"].startswith("req_")
                assert set(response.json()["error"]) == {"message", "type", "param", "code"}
            # Only the 429 came from a worker: it names it; edge-side errors have no worker.
            assert answers["429"].headers["x-sluice-worker-id"] == "worker-busy"
            assert answers["429"].headers["retry-after"] == "2"
            assert all("x-sluice-worker-id" not in r.headers for s, r in answers.items() if s != "429")
            models = await client.get(f"{base}/v1/models")
            assert models.headers["x-sluice-worker-id"] == "worker-busy"

    run(body())


def test_continuous_usage_over_http() -> None:
    fake = FakeWorker(
        script=[
            started(prompt_tokens=4),
            content("Hel", token_ids=(1, 2)),
            content("lo", token_ids=(3,)),
            finished(tokens=4),
            usage(4, 4),
        ]
    )

    async def body() -> None:
        async with (
            running_worker(fake) as address,
            running_edge([address]) as base,
            httpx.AsyncClient() as client,
        ):
            response = await client.post(
                f"{base}/v1/chat/completions",
                json={**CHAT_BODY, "stream": True, "stream_options": {"continuous_usage_stats": True}},
            )
            chunks = [data_of(f) for f in split_frames(response.content)[:-1]]
            assert [c["usage"]["completion_tokens"] for c in chunks] == [0, 2, 3, 4]
            assert all(c["usage"]["prompt_tokens"] == 4 for c in chunks)
        assert fake.requests[0].return_token_ids

    run(body())


def test_a_model_object_shows_the_workers_chat_formats() -> None:
    from edge.routes.models import model_object
    from sluice.v1 import worker_pb2

    formats = worker_pb2.ChatFormats(
        family="openai", tool_call_parser="openai", reasoning_parser="", thinking_switch="reasoning_effort"
    )
    shown = model_object(worker_pb2.ModelInfo(id="m", created=1, chat_formats=formats))
    assert shown["chat_formats"] == {
        "family": "openai",
        "tool_call_parser": "openai",
        "reasoning_parser": None,
        "thinking_switch": "reasoning_effort",
    }
    assert "chat_formats" not in model_object(worker_pb2.ModelInfo(id="m", created=1))
