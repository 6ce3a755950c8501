"""Edge security on real processes: keys never logged, no internal detail in error bodies,
and no concurrency slot leaked by clients that go away.

Real workers running no model (``--fake-tokens``, 10 ms a step: what streams does not matter,
and a slept step costs no CPU) and real edges, talking real gRPC and HTTP.
"""

from __future__ import annotations

import json
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.processes import EdgeProcess, WorkerProcess, free_port, scrape_metrics

pytestmark = pytest.mark.integration

GOOD_KEYS = ("sk-good-4f1d2c9e8b7a", "sk-other-0a9b8c7d6e5f")
BAD_TOKENS = ("sk-bad-77aa66bb55cc", "sk-good-4f1d2c9e8b7", "not-a-bearer-5e5e5e")
# Edges here need no drain delay on shutdown (nothing balances load onto them).
FAST_STOP = ["--drain-delay", "0"]
FAKE = ["--fake-tokens", "--fake-step-ms", "10"]
LEAKS = ("Traceback", "127.0.0.1", "grpc", "StatusCode", "Error(", 'File "', ".py")


def chat_body(model: str, **extra: object) -> dict[str, object]:
    return {"model": model, "messages": [{"role": "user", "content": "Tell me a story."}], **extra}


@pytest.fixture(scope="module")
def tiny_worker(
    model_cache: Path, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[WorkerProcess]:
    log_dir = tmp_path_factory.mktemp("security-worker")
    extra = ["--log-level", "DEBUG", *FAKE]
    with WorkerProcess(
        cache_dir=model_cache, log_dir=log_dir, model=str(tiny_model_dir), extra=extra
    ) as worker:
        yield worker


@pytest.fixture(scope="module")
def keyed_edge(tiny_worker: WorkerProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EdgeProcess]:
    """An edge with API keys, a per-key limit of 2, logging at DEBUG."""
    extra = [
        *FAST_STOP,
        "--api-keys",
        ",".join(GOOD_KEYS),
        "--log-level",
        "DEBUG",
        "--max-concurrent-per-key",
        "2",
    ]
    log_dir = tmp_path_factory.mktemp("security-edge")
    with EdgeProcess([tiny_worker.address], log_dir=log_dir, extra=extra) as edge:
        yield edge


def model_of(edge: EdgeProcess, key: str) -> str:
    listing = httpx.get(f"{edge.base_url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10)
    assert listing.status_code == 200
    model: str = listing.json()["data"][0]["id"]
    return model


def test_keys_are_never_logged_even_at_debug(keyed_edge: EdgeProcess, tiny_worker: WorkerProcess) -> None:
    model = model_of(keyed_edge, GOOD_KEYS[0])
    url = f"{keyed_edge.base_url}/v1/chat/completions"
    marker = f"keys-{uuid.uuid4().hex}"
    with httpx.Client(timeout=30) as client:
        for key in GOOD_KEYS:
            headers = {"Authorization": f"Bearer {key}", "X-Request-ID": f"{marker}-good"}
            assert client.post(url, json=chat_body(model, max_tokens=4), headers=headers).status_code == 200
            stream = client.post(url, json=chat_body(model, max_tokens=4, stream=True), headers=headers)
            assert stream.status_code == 200 and stream.text.endswith("data: [DONE]\n\n")
        for header in (*(f"Bearer {t}" for t in BAD_TOKENS), f"Basic {GOOD_KEYS[0]}", BAD_TOKENS[0]):
            refused = client.post(
                url, json=chat_body(model), headers={"Authorization": header, "X-Request-ID": f"{marker}-bad"}
            )
            assert refused.status_code == 401
            assert all(secret not in refused.text for secret in (*GOOD_KEYS, *BAD_TOKENS))
    # Both processes log unbuffered; wait for the edge's line about the last refused request.
    deadline = time.monotonic() + 30
    while f"{marker}-bad" not in keyed_edge.log_path.read_text(errors="replace"):
        assert time.monotonic() < deadline, "the edge never logged the refused requests"
        time.sleep(0.05)
    for process in (keyed_edge, tiny_worker):
        text = process.log_path.read_text(errors="replace")
        assert "DEBUG" in text  # the log really was at DEBUG
        for secret in (*GOOD_KEYS, *BAD_TOKENS):
            assert secret not in text, f"{secret} appears in the {process.name} log"
    edge_log = keyed_edge.log_path.read_text(errors="replace")
    # The refused requests were logged (so the check above looked at lines about them).
    assert f"{marker}-bad" in edge_log and f"{marker}-good" in edge_log


def test_no_slot_leaks_after_many_client_disconnects(
    keyed_edge: EdgeProcess, tiny_worker: WorkerProcess
) -> None:
    """60 streams abandoned after 0 to 4 lines, 2 at a time for one key (its limit): afterwards
    the edge holds no slot and no stream, the worker runs nothing, and the key gets its 2 slots."""
    model = model_of(keyed_edge, GOOD_KEYS[1])
    headers = {"Authorization": f"Bearer {GOOD_KEYS[1]}"}
    body = chat_body(model, max_tokens=200, stream=True)
    url = f"{keyed_edge.base_url}/v1/chat/completions"
    refused = 0
    with httpx.Client(timeout=30) as client:
        for attempt in range(30):
            with (
                client.stream("POST", url, json=body, headers=headers) as first,
                client.stream("POST", url, json=body, headers=headers) as second,
            ):
                statuses = (first.status_code, second.status_code)
                refused += statuses.count(429)
                for response in (first, second):
                    if response.status_code == 200:
                        for n, _line in enumerate(response.iter_lines()):
                            if n >= attempt % 5:  # leave after 0..4 lines
                                break
    # A round may start before the edge has torn down the last one's streams (a 429 then),
    # but most rounds must have run.
    assert refused <= 30
    edge_metrics = settle(keyed_edge.port)
    assert edge_metrics["sluice_edge_concurrency_slots_in_use"] == 0
    assert edge_metrics["sluice_edge_streams_in_flight"] == 0
    assert edge_metrics["sluice_edge_client_disconnects_total"] >= 60 - refused
    worker_idle = wait_until(lambda: tiny_worker.metrics()["sluice_worker_running_requests"] == 0, 15)
    assert worker_idle
    # The worker logged the abandoned requests as cancelled (its per-request end line).
    assert "cancelled by the caller" in tiny_worker.log_path.read_text(errors="replace")
    print(f"refused while earlier streams were still being torn down: {refused} of 60")
    with (
        httpx.Client(timeout=30) as client,
        client.stream("POST", url, json=body, headers=headers) as a,
        client.stream("POST", url, json=body, headers=headers) as b,
    ):
        assert (a.status_code, b.status_code) == (200, 200)
        over = client.post(url, json=body, headers=headers)
        assert over.status_code == 429 and over.json()["error"]["code"] == "concurrency_limit_exceeded"


def wait_until(predicate: Callable[[], bool], within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def settle(edge_port: int, within_s: float = 15.0) -> dict[str, float]:
    """The edge's metrics once no slot and no stream is held (or after ``within_s``)."""
    deadline = time.monotonic() + within_s
    while True:
        metrics = scrape_metrics(edge_port)
        idle = (
            metrics["sluice_edge_concurrency_slots_in_use"] == 0
            and metrics["sluice_edge_streams_in_flight"] == 0
        )
        if idle or time.monotonic() > deadline:
            return metrics
        time.sleep(0.05)


def assert_clean(text: str, *addresses: str) -> None:
    for leak in (*LEAKS, *addresses):
        assert leak not in text, f"{leak!r} leaked into {text!r}"


def test_a_worker_that_dies_mid_stream_and_a_dead_address_give_clean_errors(
    model_cache: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    dead = f"127.0.0.1:{free_port()}"
    with (
        WorkerProcess(
            cache_dir=model_cache, log_dir=tmp_path, model=str(tiny_model_dir), extra=FAKE
        ) as victim,
        EdgeProcess([victim.address, dead], log_dir=tmp_path, extra=FAST_STOP) as edge,
    ):
        model = httpx.get(f"{edge.base_url}/v1/models", timeout=10).json()["data"][0]["id"]
        url = f"{edge.base_url}/v1/chat/completions"
        port = str(victim.port)
        with httpx.Client(timeout=60) as client:
            with client.stream("POST", url, json=chat_body(model, max_tokens=450, stream=True)) as response:
                assert response.status_code == 200
                lines = response.iter_lines()
                for line in lines:
                    if '"content":"' in line and '"content":""' not in line:
                        break
                assert victim.proc is not None
                victim.proc.send_signal(signal.SIGKILL)  # the worker dies mid-stream
                rest = "\n".join(lines)
            assert "event: error" in rest and rest.rstrip().endswith("data: [DONE]")
            assert_clean(rest, victim.address, dead, port)
            error = json.loads(rest.split("event: error\ndata: ", 1)[1].split("\n", 1)[0])["error"]
            print("mid-stream error after the worker died:", error)
            assert error["type"] in ("server_error", "api_error")

            # Every worker is now gone or was never there: plain errors, no address in them.
            for path, payload in (
                ("/v1/chat/completions", chat_body(model)),
                ("/v1/completions", {"model": model, "prompt": "x"}),
            ):
                answer = client.post(f"{edge.base_url}{path}", json=payload)
                assert answer.status_code == 503
                assert_clean(answer.text, victim.address, dead, port)
            models = client.get(f"{edge.base_url}/v1/models")
            assert models.status_code == 503
            assert_clean(models.text, victim.address, dead, port)
