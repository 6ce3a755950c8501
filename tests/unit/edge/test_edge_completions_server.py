"""/v1/completions served by hypercorn in-process against scripted fake workers."""

from __future__ import annotations

import json

import grpc
import httpx
import openai
import pytest
from edge_fakes import (
    Abort,
    FakeWorker,
    Hang,
    Sleep,
    Step,
    content,
    finished,
    run,
    running_edge,
    running_worker,
    usage,
    wait_for,
)

from sluice.status import ErrorDetails
from sluice.v1 import worker_pb2

MODEL = "SmolLM2-135M-Instruct"


def echo_started(prompt: str, n: int = 1) -> worker_pb2.GenerateResponse:
    return worker_pb2.GenerateResponse(
        started=worker_pb2.Started(
            model=MODEL, worker_id="worker-a", prompt_tokens=2, n=n, prompt_text=prompt
        )
    )


def by_prompt(request: worker_pb2.GenerateRequest) -> list[Step]:
    """Each prompt's answer is its text reversed, one choice per requested n."""
    prompt = request.prompt.text
    n = request.sampling.n or 1
    steps: list[Step] = [echo_started(prompt, n)]
    steps += [content(prompt[::-1], index=i) for i in range(n)]
    steps += [finished(index=i, tokens=1) for i in range(n)]
    steps.append(usage(prompt=2, completion=n))
    return steps


def test_several_prompts_fan_out_and_merge_in_index_order() -> None:
    fake = FakeWorker(script_for=by_prompt)

    async def body() -> None:
        async with (
            running_worker(fake) as address,
            running_edge([address]) as base,
            httpx.AsyncClient() as client,
        ):
            response = await client.post(
                f"{base}/v1/completions",
                json={"model": MODEL, "prompt": ["ab", "cd", "ef"], "n": 2, "echo": True},
            )
            assert response.status_code == 200, response.text
            assert response.headers["content-type"] == "application/json"
            assert response.headers["x-sluice-worker-id"] == "worker-a"
            result = response.json()
            assert result["object"] == "text_completion" and result["id"].startswith("cmpl-")
            assert [(c["index"], c["text"]) for c in result["choices"]] == [
                (0, "abba"),
                (1, "abba"),
                (2, "cddc"),
                (3, "cddc"),
                (4, "effe"),
                (5, "effe"),
            ]
            assert result["usage"]["prompt_tokens"] == 6 and result["usage"]["completion_tokens"] == 6
        assert sorted(r.prompt.text for r in fake.requests) == ["ab", "cd", "ef"]
        assert all(r.echo_prompt and r.sampling.n == 2 for r in fake.requests)

    run(body())


def test_streamed_completion_through_the_sdk() -> None:
    fake = FakeWorker(script_for=by_prompt)

    async def body() -> None:
        async with running_worker(fake) as address, running_edge([address]) as base:
            client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
            stream = await client.completions.create(
                model=MODEL, prompt=["xy", "zw"], stream=True, stream_options={"include_usage": True}
            )
            texts: dict[int, str] = {}
            finishes: dict[int, str] = {}
            chunks = [chunk async for chunk in stream]
            for chunk in chunks[:-1]:
                assert chunk.object == "text_completion" and chunk.usage is None
                (choice,) = chunk.choices
                texts[choice.index] = texts.get(choice.index, "") + choice.text
                if choice.finish_reason:
                    finishes[choice.index] = choice.finish_reason
            assert texts == {0: "yx", 1: "wz"} and finishes == {0: "stop", 1: "stop"}
            assert chunks[-1].choices == [] and chunks[-1].usage is not None
            assert chunks[-1].usage.completion_tokens == 2
            await client.close()

    run(body())


def test_a_failing_prompt_fails_the_request_and_cancels_the_others() -> None:
    def script(request: worker_pb2.GenerateRequest) -> list[Step]:
        if request.prompt.text == "bad":
            return [
                Abort(
                    ErrorDetails(
                        grpc.StatusCode.INVALID_ARGUMENT, "prompt is bad", "invalid_parameter", "prompt"
                    )
                )
            ]
        return [echo_started(request.prompt.text), Hang()]

    fake = FakeWorker(script_for=script)

    async def body() -> None:
        async with (
            running_worker(fake) as address,
            running_edge([address]) as base,
            httpx.AsyncClient() as client,
        ):
            response = await client.post(
                f"{base}/v1/completions",
                json={"model": MODEL, "prompt": ["ok", "bad", "fine"], "stream": True},
            )
            assert response.status_code == 400
            assert response.headers["content-type"] == "application/json"
            assert response.json()["error"]["param"] == "prompt"
            # The worker answered, so its id is named (learned with ListModels).
            assert response.headers["x-sluice-worker-id"] == "worker-a"
            await wait_for(lambda: fake.calls_cancelled == 2)

    run(body())


def test_client_disconnect_cancels_every_prompt_call() -> None:
    def script(request: worker_pb2.GenerateRequest) -> list[Step]:
        return [echo_started(request.prompt.text), content("x"), Hang()]

    fake = FakeWorker(script_for=script)

    async def body() -> None:
        async with (
            running_worker(fake) as address,
            running_edge([address]) as base,
            httpx.AsyncClient() as client,
        ):
            async with client.stream(
                "POST", f"{base}/v1/completions", json={"model": MODEL, "prompt": ["a", "b"], "stream": True}
            ) as response:
                seen = b""
                async for piece in response.aiter_raw():
                    seen += piece
                    if seen.count(b'"text":"x"') == 2:
                        break
            await wait_for(lambda: fake.calls_cancelled == 2)

            async def slots_released() -> bool:
                return bool((await client.get(f"{base}/ready")).json()["workers"][0]["outstanding"] == 0)

            await wait_for(slots_released)

    run(body())


def test_mid_stream_failure_of_one_prompt_ends_the_stream_with_an_error_event() -> None:
    def script(request: worker_pb2.GenerateRequest) -> list[Step]:
        if request.prompt.text == "dies":
            return [echo_started("dies"), Sleep(0.05), Abort(ErrorDetails(grpc.StatusCode.INTERNAL, "boom"))]
        return [echo_started(request.prompt.text), Hang()]

    fake = FakeWorker(script_for=script)

    async def body() -> None:
        async with (
            running_worker(fake) as address,
            running_edge([address]) as base,
            httpx.AsyncClient() as client,
        ):
            response = await client.post(
                f"{base}/v1/completions", json={"model": MODEL, "prompt": ["dies", "waits"], "stream": True}
            )
            frames = response.text.rstrip("\n").split("\n\n")
            assert frames[-2].startswith("event: error\ndata: ")
            assert json.loads(frames[-2].split("data: ", 1)[1])["error"]["type"] == "api_error"
            assert frames[-1] == "data: [DONE]"
            await wait_for(lambda: fake.calls_cancelled >= 1)

    run(body())


def test_validation_errors_never_reach_a_worker() -> None:
    fake = FakeWorker(script_for=by_prompt)

    async def body() -> None:
        async with (
            running_worker(fake) as address,
            running_edge([address]) as base,
            httpx.AsyncClient() as client,
        ):
            for body_, param in [
                ({"model": MODEL, "prompt": "x", "suffix": "y", "echo": True}, "suffix"),
                ({"model": MODEL, "prompt": "x", "best_of": 3}, "best_of"),
                ({"model": MODEL, "prompt": "x", "max_tokens": 0}, "max_tokens"),
                ({"model": MODEL, "prompt": [1, "a"]}, "prompt"),
            ]:
                response = await client.post(f"{base}/v1/completions", json=body_)
                assert response.status_code == 400 and response.json()["error"]["param"] == param
                assert "x-sluice-worker-id" not in response.headers  # no worker was chosen
                assert response.headers["x-request-id"].startswith("req_")
            listed = await client.post(f"{base}/v1/completions", json=["not", "an", "object"])
            assert listed.status_code == 422 and listed.json()["error"]["code"] == "invalid_type"
        assert fake.calls_started == 0

    run(body())


def test_client_gone_while_prompts_are_still_opening_cancels_every_call() -> None:
    def script(request: worker_pb2.GenerateRequest) -> list[Step]:
        # "fast" starts at once; "slow" never does: the edge is still waiting to commit.
        return [echo_started("fast"), Hang()] if request.prompt.text == "fast" else [Hang()]

    fake = FakeWorker(script_for=script)

    async def body() -> None:
        async with running_worker(fake) as address, running_edge([address]) as base:
            async with httpx.AsyncClient(timeout=0.5) as client:
                with pytest.raises(httpx.ReadTimeout):
                    await client.post(
                        f"{base}/v1/completions", json={"model": MODEL, "prompt": ["fast", "slow"]}
                    )
            await wait_for(lambda: fake.calls_cancelled == 2)

    run(body())


def test_a_prompt_failing_fails_fast_while_another_is_still_opening() -> None:
    def script(request: worker_pb2.GenerateRequest) -> list[Step]:
        if request.prompt.text == "bad":
            return [
                Sleep(0.1),
                Abort(ErrorDetails(grpc.StatusCode.INVALID_ARGUMENT, "no", "invalid_parameter", "prompt")),
            ]
        return [Hang()]  # never starts: the edge would wait worker_connect_timeout_s for it

    fake = FakeWorker(script_for=script)

    async def body() -> None:
        async with (
            running_worker(fake) as address,
            running_edge([address], worker_connect_timeout_s=30) as base,
            httpx.AsyncClient() as client,
        ):
            response = await client.post(
                f"{base}/v1/completions", json={"model": MODEL, "prompt": ["slow", "bad"]}
            )
            assert response.status_code == 400 and response.elapsed.total_seconds() < 5
            await wait_for(lambda: fake.calls_cancelled == 1)

    run(body())
