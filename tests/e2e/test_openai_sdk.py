"""The official openai SDK against a real edge and a real worker serving the default model."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

pytestmark = pytest.mark.e2e

MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest.fixture(scope="module")
def client(default_edge) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{default_edge.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def sse_lines(edge, body: dict) -> tuple[httpx.Response, list[str]]:
    with httpx.stream("POST", f"{edge.base_url}/v1/chat/completions", json=body, timeout=120) as response:
        lines = list(response.iter_lines())
    return response, lines


def test_models_lists_the_default_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


def test_streaming_matches_non_streaming_at_temperature_zero(client):
    whole = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=40)
    choice = whole.choices[0]
    assert choice.message.role == "assistant" and "Paris" in choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert whole.usage.prompt_tokens > 0 and whole.usage.completion_tokens > 0
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens

    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=QUESTION,
            temperature=0,
            max_tokens=40,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
    assert all(c.object == "chat.completion.chunk" and c.model == MODEL for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [choice.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_max_tokens_gives_length(client):
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=3)
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 3
    chunks = list(client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=3, stream=True))
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["length"]


def test_stop_string_never_appears(client):
    messages = [{"role": "user", "content": "List the numbers from 1 to 20 separated by commas."}]
    full = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=60)
    text = full.choices[0].message.content
    stop = "7"
    assert stop in text
    for stream in (False, True):
        reply = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            temperature=0,
            max_tokens=60,
            stop=[stop, "never-seen"],
            stream=stream,
        )
        if stream:
            chunks = list(reply)
            out = "".join(c.choices[0].delta.content or "" for c in chunks)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
        else:
            out, finish = reply.choices[0].message.content, [reply.choices[0].finish_reason]
        assert stop not in out and text.startswith(out)
        assert finish == ["stop"]


def test_raw_sse_wire_format(default_edge):
    response, lines = sse_lines(
        default_edge, {"model": MODEL, "messages": QUESTION, "stream": True, "max_tokens": 8}
    )
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["cache-control"] == "no-cache"
    assert response.headers["x-request-id"] and response.headers["x-sluice-worker-id"]
    events = [line for line in lines if line]
    assert all(line.startswith("data: ") for line in events), "no event:/id: lines on a normal stream"
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["delta"] == {} and chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all("content" in c["choices"][0]["delta"] for c in chunks[1:-1])
    for chunk in chunks:
        assert {"id", "object", "created", "model", "system_fingerprint", "choices"} <= chunk.keys()


def test_request_id_is_echoed(default_edge):
    response = httpx.post(
        f"{default_edge.base_url}/v1/chat/completions",
        timeout=60,
        json={"model": MODEL, "messages": QUESTION, "max_tokens": 2},
        headers={"X-Request-ID": "my-trace-123"},
    )
    assert response.status_code == 200 and response.headers["x-request-id"] == "my-trace-123"
    assert response.headers["content-type"].startswith("application/json")


def test_errors_map_to_sdk_exceptions(client):
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=7)
    assert bad.value.status_code == 400 and bad.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "x"}])
    assert "role" in (bad.value.param or "")
    with pytest.raises(openai.BadRequestError) as bad:  # too long for the context: the worker's check
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "word " * 9000}])
    assert bad.value.param == "messages"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=QUESTION)
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    with pytest.raises(openai.BadRequestError):  # a streaming request fails before any chunk
        list(client.chat.completions.create(model=MODEL, messages=[], stream=True))


def test_breaking_out_of_a_stream_cancels_the_worker(client, default_worker):
    before = default_worker.metrics()
    stream = client.chat.completions.create(
        model=MODEL,
        stream=True,
        max_tokens=2000,
        messages=[{"role": "user", "content": "Write a very long story about a dragon and a knight."}],
    )
    received = 0
    for chunk in stream:
        received += bool(chunk.choices and chunk.choices[0].delta.content)
        if received == 3:
            break
    stream.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        now = default_worker.metrics()
        if now["sluice_worker_requests_cancelled_total"] > before["sluice_worker_requests_cancelled_total"]:
            break
        time.sleep(0.05)
    assert (
        now["sluice_worker_requests_cancelled_total"] == before["sluice_worker_requests_cancelled_total"] + 1
    )
    assert now["sluice_worker_running_sequences"] == 0
    generated = now["sluice_worker_generated_tokens_total"] - before["sluice_worker_generated_tokens_total"]
    assert generated < 50, f"{generated} tokens generated after the client left at 3"
