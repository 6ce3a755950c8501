"""Issue 47's bar in one stack, through the official openai SDK: ``make run``'s stack (an edge with
its own SQLite store, a worker serving the default model), both exporting traces to an OTLP
collector run by the test. A chat
completion sent with a ``traceparent`` is traced by both services under that trace id; a 5-line
batch completes with 5 results; a stored response continued with ``previous_response_id`` (the
earlier turn in its prompt) gets more cached tokens than a fresh conversation, and is retrieved and
deleted; a background response is polled to completion."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.e2e.test_stored_responses import FIRST, SYSTEM, poll
from tests.otlp import Collector, by_name, otlp_collector
from tests.processes import EdgeProcess, WorkerProcess

pytestmark = pytest.mark.e2e

MODEL = "SmolLM2-135M-Instruct"
TRACE_ID = "5bf92f3577b34da6a3ce929d0e0e4737"


@pytest.fixture(scope="module")
def collector() -> Iterator[tuple[Collector, str]]:
    with otlp_collector() as served:
        yield served


@pytest.fixture(scope="module")
def client(
    collector: tuple[Collector, str], model_cache: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[openai.OpenAI]:
    """The SDK's client of an edge and a default-model worker that both trace to ``collector``."""
    endpoint = ["--otlp-traces-endpoint", collector[1]]
    folder = tmp_path_factory.mktemp("bar47")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # the processes export within 50 ms, not 5 s
        with (
            WorkerProcess(cache_dir=model_cache, log_dir=folder, extra=endpoint) as worker,
            EdgeProcess(
                [worker.address], log_dir=folder, extra=[*endpoint, "--state-dir", str(folder / "state")]
            ) as edge,
        ):
            yield openai.OpenAI(base_url=f"{edge.base_url}/v1", api_key="none", max_retries=0)


def test_a_traced_chat_a_batch_a_continued_and_a_background_response(
    client: openai.OpenAI, collector: tuple[Collector, str]
) -> None:
    # A chat completion with the client's traceparent: spans of both services under its trace id.
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Tell me about the town."}],
        max_tokens=6,
        extra_headers={"traceparent": f"00-{TRACE_ID}-00f067aa0ba902b7-01"},
    )
    assert chat.usage is not None
    call = by_name(collector[0].wait_for(TRACE_ID, 2, 4), "sluice-worker")[f"chat {MODEL}"]
    assert call["attributes"]["gen_ai.request.model"] == MODEL
    assert call["attributes"]["gen_ai.usage.input_tokens"] == chat.usage.prompt_tokens
    assert call["attributes"]["gen_ai.usage.output_tokens"] == chat.usage.completion_tokens > 0

    # A 5-line batch completes with 5 results.
    lines = [
        {
            "custom_id": f"line-{n}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
        }
        for n in range(5)
    ]
    upload = client.files.create(
        file=("in.jsonl", "".join(json.dumps(line) + "\n" for line in lines).encode()), purpose="batch"
    )
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    done = poll(
        lambda: client.batches.retrieve(batch.id), lambda b: b.status == "completed", "the batch ends"
    )
    assert done.request_counts is not None and done.request_counts.completed == 5
    assert done.output_file_id is not None
    assert len(client.files.content(done.output_file_id).text.splitlines()) == 5

    # A stored response continued: the earlier turn is in the prompt, from the prefix cache; the
    # continuation is retrieved, then deleted.
    settings: dict[str, Any] = {"model": MODEL, "instructions": SYSTEM, "max_output_tokens": 8}
    first = client.responses.create(input=FIRST, **settings)
    fresh = client.responses.create(input="Which color is the sky?", **settings)
    follow = client.responses.create(input="And for the cushions?", previous_response_id=first.id, **settings)
    assert follow.usage is not None and fresh.usage is not None and first.usage is not None
    assert follow.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert follow.usage.input_tokens_details.cached_tokens > fresh.usage.input_tokens_details.cached_tokens
    assert client.responses.retrieve(follow.id).output_text == follow.output_text
    client.responses.delete(follow.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(follow.id)

    # A background response answers at once and is polled to completion.
    job = client.responses.create(model=MODEL, input="Name a color.", background=True, max_output_tokens=4)
    assert job.status == "queued"
    ended = poll(
        lambda: client.responses.retrieve(job.id),
        lambda r: r.status not in ("queued", "in_progress"),
        "it ends",
    )
    assert ended.status in ("completed", "incomplete") and ended.usage is not None
