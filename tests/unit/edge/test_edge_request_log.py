"""Request logs (``--log-requests``): one JSON line per API request, from an in-process edge in front
of a fake worker: ids, the key's id and never the key, model, tokens, finish reasons, timings, the
first characters of prompt and output, a stream's line at its end, a refused request's line."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from edge_fakes import (
    CHAT_BODY,
    FakeWorker,
    content,
    finished,
    run,
    running_edge,
    running_worker,
    started,
    usage,
)

from edge.auth import key_id
from edge.request_log import log as request_log
from edge.request_log import prompt_text
from edge.settings import Settings
from sluice.v1 import worker_pb2

KEY = "sk-secret-key-1"
SCRIPT = [started(prompt_tokens=5), content("Hello world"), finished(tokens=2), usage(5, 2)]


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[dict[str, Any]] = []
        self.raw: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.raw.append(record.getMessage())
        self.lines.append(json.loads(record.getMessage()))


@pytest.fixture
def lines() -> Iterator[Lines]:
    handler = Lines()
    request_log.addHandler(handler)
    yield handler
    request_log.removeHandler(handler)


def test_every_api_request_has_one_line_with_its_ids_tokens_and_text(lines: Lines) -> None:
    fake = FakeWorker(script=SCRIPT)

    async def scenario() -> list[str]:
        async with (
            running_worker(fake) as address,
            running_edge([address], api_keys=(KEY,), log_requests=True, log_request_text=5) as base,
            httpx.AsyncClient(headers={"Authorization": f"Bearer {KEY}"}) as client,
            httpx.AsyncClient() as stranger,
        ):
            plain = await client.post(f"{base}/v1/chat/completions", json=CHAT_BODY)
            streamed = await client.post(f"{base}/v1/chat/completions", json={**CHAT_BODY, "stream": True})
            refused = await stranger.post(f"{base}/v1/chat/completions", json=CHAT_BODY)
            await client.get(f"{base}/health")  # not an API request: no line
            assert (plain.status_code, streamed.status_code, refused.status_code) == (200, 200, 401)
            return [
                plain.headers["X-Request-ID"],
                streamed.headers["X-Request-ID"],
                refused.headers["X-Request-ID"],
            ]

    ids = run(scenario())
    assert [line["request_id"] for line in lines.lines] == ids
    plain, streamed, refused = lines.lines
    assert plain["key_id"] == key_id(KEY) and plain["status"] == 200 and plain["outcome"] == "completed"
    assert plain["model"] == "SmolLM2-135M-Instruct" and plain["worker_ids"] == ["worker-a"]
    assert (plain["prompt_tokens"], plain["completion_tokens"], plain["cached_tokens"]) == (5, 2, 0)
    assert plain["finish_reasons"] == ["stop"] and plain["stream"] is False
    assert plain["prompt"] == "user:" and plain["output"] == "Hello"  # the first 5 characters
    assert (
        plain["response_id"].startswith("chatcmpl-") and plain["duration_s"] >= plain["first_output_s"] >= 0
    )
    assert streamed["stream"] is True and streamed["outcome"] == "completed" and streamed["output"] == "Hello"
    assert streamed["response_id"].startswith("chatcmpl-") and streamed["completion_tokens"] == 2
    assert refused["status"] == 401 and refused["key_id"] is None and refused["error"] == "invalid_api_key"
    assert refused["model"] is None and refused["prompt"] is None
    assert not any(KEY in raw for raw in lines.raw)


def test_without_text_a_line_holds_no_prompt_or_output(lines: Lines) -> None:
    fake = FakeWorker(script=SCRIPT)

    async def scenario() -> None:
        async with (
            running_worker(fake) as address,
            running_edge([address], log_requests=True) as base,
            httpx.AsyncClient() as client,
        ):
            assert (await client.post(f"{base}/v1/chat/completions", json=CHAT_BODY)).status_code == 200

    run(scenario())
    [line] = lines.lines
    assert "prompt" not in line and "output" not in line and line["key_id"] is None


def test_text_needs_the_switch() -> None:
    with pytest.raises(ValueError, match="log_request_text"):
        Settings(workers=("127.0.0.1:1",), log_request_text=10)


def test_a_prompt_as_text() -> None:
    chat = worker_pb2.GenerateRequest(
        chat=worker_pb2.ChatInput(
            messages=[
                worker_pb2.ChatMessage(role="system", content="Be brief."),
                worker_pb2.ChatMessage(role="user"),
            ]
        )
    )
    assert prompt_text(chat) == "system: Be brief.\nuser: "
    raw = worker_pb2.GenerateRequest(prompt=worker_pb2.PromptInput(text="Once upon"))
    assert prompt_text(raw) == "Once upon"
