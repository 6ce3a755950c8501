"""The Files and Batch APIs through the official openai SDK, end to end on both state stores: an
edge on embedded SQLite and one on a real PostgreSQL, each with two API keys, in front of one
``--fake-tokens`` worker (``--scheduling-policy priority``) this module starts. A batch runs each
line once at the batch priority, with its output and error files; a bad file fails validation
with line numbers; a cancel ends a batch cancelled; a batch survives an edge restart, and a
background response an edge killed with SIGKILL (re-run by its restart)."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.e2e.test_stored_responses import poll
from tests.processes import EdgeProcess, WorkerProcess

pytestmark = pytest.mark.e2e

MODEL = "SmolLM2-135M-Instruct"
KEYS = ("key-alice", "key-bob")
FINAL = ("completed", "failed", "expired", "cancelled")
# Lines run two at a time: a batch of a few slow lines is still running when a test acts on it.
CONCURRENCY = 2
MAX_FILE_BYTES = 16384
# A killed edge's background responses are taken over this many seconds after its last renewal.
LEASE_S = 2.0


@pytest.fixture(scope="module")
def worker(model_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    extra = ["--fake-tokens", "--fake-step-ms", "5", "--scheduling-policy", "priority"]
    with WorkerProcess(
        cache_dir=model_cache, log_dir=tmp_path_factory.mktemp("batch-worker"), extra=extra
    ) as w:
        yield w


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def edge(
    request: pytest.FixtureRequest, worker: WorkerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EdgeProcess]:
    folder = tmp_path_factory.mktemp(f"batch-edge-{request.param}")
    if request.param == "sqlite":
        store = ["--state-dir", str(folder / "state")]
    else:
        store = ["--state-url", request.getfixturevalue("postgres_url")]
    extra = ["--api-keys", ",".join(KEYS), "--batch-concurrency", str(CONCURRENCY), *store]
    extra += ["--max-file-bytes", str(MAX_FILE_BYTES), "--state-lease", str(LEASE_S)]
    with EdgeProcess([worker.address], log_dir=folder, extra=extra) as process:
        yield process


@pytest.fixture(scope="module")
def alice(edge: EdgeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{edge.base_url}/v1", api_key=KEYS[0], max_retries=0)


@pytest.fixture(scope="module")
def bob(edge: EdgeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{edge.base_url}/v1", api_key=KEYS[1], max_retries=0)


def chat_line(custom_id: str, tokens: int = 4, **body: Any) -> dict[str, Any]:
    request = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": tokens}
    request["ignore_eos"] = True
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {**request, **body},
    }


def submit(client: openai.OpenAI, lines: list[dict[str, Any]] | str, **options: Any) -> Any:
    """Uploads ``lines`` (or a file's text) and creates a chat-completions batch of it."""
    text = lines if isinstance(lines, str) else "".join(json.dumps(line) + "\n" for line in lines)
    uploaded = client.files.create(file=("input.jsonl", text.encode()), purpose="batch")
    return client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h", **options
    )


def ended(client: openai.OpenAI, batch_id: str) -> Any:
    return poll(lambda: client.batches.retrieve(batch_id), lambda b: b.status in FINAL, "the batch ends")


def read_lines(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def test_a_batch_answers_each_line_once_in_its_output_and_error_files(
    alice: openai.OpenAI, bob: openai.OpenAI, worker: WorkerProcess
) -> None:
    lines = [chat_line(f"req-{n}") for n in range(4)] + [chat_line("bad", tokens=-1)]
    batch = submit(alice, lines, metadata={"job": "nightly"})
    assert batch.status == "validating" and batch.metadata == {"job": "nightly"}
    assert batch.completion_window == "24h" and batch.expires_at == batch.created_at + 24 * 3600
    done = ended(alice, batch.id)
    assert done.status == "completed" and done.completed_at and done.in_progress_at and done.finalizing_at
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (5, 4, 1)
    output = read_lines(alice, done.output_file_id)
    assert [line["custom_id"] for line in output] == ["req-0", "req-1", "req-2", "req-3"]
    for line in output:
        assert line["error"] is None and line["response"]["status_code"] == 200
        assert line["response"]["request_id"] and line["id"].startswith("batch_req_")
        assert line["response"]["body"]["object"] == "chat.completion"
        assert line["response"]["body"]["usage"]["completion_tokens"] == 4
    (error,) = read_lines(alice, done.error_file_id)
    assert error["custom_id"] == "bad" and error["response"]["status_code"] == 400
    assert error["response"]["body"]["error"]["param"] == "max_tokens"
    # Sent at the batch priority, the lowest (the worker's metrics by priority say so).
    with urllib.request.urlopen(f"http://127.0.0.1:{worker.metrics_port}/metrics", timeout=5) as answer:
        assert 'priority="2147483647"' in answer.read().decode()

    assert batch.id in [b.id for b in alice.batches.list(limit=100)]
    assert alice.files.retrieve(done.output_file_id).purpose == "batch_output"  # type: ignore[arg-type]
    # Another key reaches none of it.
    for attempt in (
        lambda: bob.batches.retrieve(batch.id),
        lambda: bob.batches.cancel(batch.id),
        lambda: bob.files.retrieve(batch.input_file_id),
        lambda: bob.files.content(done.output_file_id),  # type: ignore[arg-type]
        lambda: bob.files.delete(batch.input_file_id),
    ):
        with pytest.raises(openai.NotFoundError):
            attempt()
    assert batch.id not in [b.id for b in bob.batches.list()]
    assert alice.files.delete(batch.input_file_id).deleted
    with pytest.raises(openai.NotFoundError):
        alice.files.retrieve(batch.input_file_id)


def test_a_bad_input_file_fails_the_batch_naming_its_lines(alice: openai.OpenAI) -> None:
    good = json.dumps(chat_line("a"))
    wrong_url = json.dumps({**chat_line("c"), "url": "/v1/embeddings"})
    text = "\n".join([good, "{not json", good, wrong_url, json.dumps(chat_line("d", stream=True))]) + "\n"
    failed = ended(alice, submit(alice, text).id)
    assert failed.status == "failed" and failed.failed_at and failed.output_file_id is None
    assert failed.errors is not None
    found = [(e.line, e.code, e.param) for e in failed.errors.data or []]
    assert found == [
        (2, "invalid_json_line", None),
        (3, "duplicate_custom_id", "custom_id"),
        (4, "invalid_url", "url"),
        (5, "invalid_request", "body.stream"),
    ]


def test_files_are_refused_over_the_size_limit_and_without_purpose_batch(alice: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        alice.files.create(file=("x.jsonl", b"{}\n"), purpose="fine-tune")
    assert caught.value.body["param"] == "purpose"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as caught:
        alice.files.create(file=("big.jsonl", b"x" * (MAX_FILE_BYTES + 1)), purpose="batch")
    assert caught.value.code == "file_too_large" and str(MAX_FILE_BYTES) in caught.value.message
    with pytest.raises(openai.BadRequestError):
        alice.batches.create(
            input_file_id="file-none", endpoint="/v1/chat/completions", completion_window="24h"
        )


def test_a_cancelled_batch_ends_cancelled_with_what_it_answered(alice: openai.OpenAI) -> None:
    batch = submit(alice, [chat_line(f"slow-{n}", tokens=60) for n in range(12)])
    poll(
        lambda: alice.batches.retrieve(batch.id),
        lambda b: b.request_counts.completed >= 1,
        "a line is answered",
    )
    assert alice.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    done = ended(alice, batch.id)
    assert done.status == "cancelled" and done.cancelling_at and done.cancelled_at
    answered = read_lines(alice, done.output_file_id)
    assert 1 <= len(answered) == done.request_counts.completed < 12
    assert alice.batches.cancel(batch.id).status == "cancelled"  # a cancelled one is answered as it is


def test_a_batch_survives_an_edge_restart_with_each_line_run_once(
    alice: openai.OpenAI, edge: EdgeProcess, worker: WorkerProcess
) -> None:
    """The stopping edge lets the lines it runs end (none is cancelled: a line the worker was
    finishing would otherwise run to its end twice); the restarted one runs the rest."""
    metrics = worker.metrics()
    before = metrics["sluice_worker_requests_finished_total"]
    cancelled = metrics["sluice_worker_requests_cancelled_total"]
    # Lines of half a second (100 tokens of 5 ms steps): those the worker runs when the edge is told to
    # stop are still running when its runner winds down, a few milliseconds later.
    batch = submit(alice, [chat_line(f"line-{n}", tokens=100) for n in range(20)])
    poll(
        lambda: (alice.batches.retrieve(batch.id), worker.metrics()),
        lambda seen: seen[0].request_counts.completed >= 3 and seen[1]["sluice_worker_running_requests"] >= 1,
        "lines are answered and others run",
    )
    edge.stop()
    edge.start()  # the same store: the new process resumes the batch
    done = ended(alice, batch.id)
    assert done.status == "completed" and done.request_counts.completed == 20
    output = read_lines(alice, done.output_file_id)
    assert sorted(line["custom_id"] for line in output) == sorted(f"line-{n}" for n in range(20))
    # No line ran twice to its end: the worker finished exactly 20 requests, and cancelled none.
    metrics = worker.metrics()
    assert metrics["sluice_worker_requests_finished_total"] - before == 20
    assert metrics["sluice_worker_requests_cancelled_total"] == cancelled
    assert "line(s) running get" in edge.log_tail(400)


def test_a_background_response_survives_a_killed_edge_by_being_rerun(
    alice: openai.OpenAI, edge: EdgeProcess, worker: WorkerProcess
) -> None:
    tokens = 600  # 3 s of the fake worker's 5 ms steps: still running when its edge is killed
    job = alice.responses.create(
        model=MODEL,
        input="Count.",
        background=True,
        max_output_tokens=tokens,
        extra_body={"ignore_eos": True},
    )
    poll(worker.metrics, lambda m: m["sluice_worker_running_requests"] >= 1, "the worker runs it")
    edge.kill()  # no drain, no goodbye: the response stays in_progress until its lease runs out
    edge.start()  # the same store: the new process takes the response over once the lease ran out
    done = poll(
        lambda: alice.responses.retrieve(job.id),
        lambda r: r.status not in ("queued", "in_progress"),
        "it ends",
    )
    assert done.status == "incomplete" and done.usage is not None and done.usage.output_tokens == tokens
    assert (done.id, done.created_at, done.background) == (job.id, job.created_at, True)
    assert f"re-running background response {job.id}" in edge.log_tail(400)
