"""Every error status the edge sends, through the official openai SDK, to its exception class.

Real processes: the module's default worker and edge, plus edges started with API keys, a small
body limit, or only a closed port as worker, and a ``--fake-tokens`` worker with room for one
running and one queued request (to get a real 429).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.processes import EdgeProcess, LiveEdgeProcess, WorkerProcess, free_port

pytestmark = pytest.mark.e2e

MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "Hi!"}]
KEYS = "sk-e2e-one,sk-e2e-two"
# Room for one running and one queued request; no model (the text does not matter), each token
# 100 ms: a 400-token stream holds its slot for 40 s, longer than the test waits for anything.
BUSY = ["--max-running", "1", "--max-queue", "1", "--fake-tokens", "--fake-step-ms", "100"]


@contextlib.contextmanager
def edge(workers: list[str], log_dir: Path, *extra: str) -> Iterator[EdgeProcess]:
    with LiveEdgeProcess(workers, log_dir=log_dir, extra=list(extra)) as process:
        yield process


def sdk(process: EdgeProcess, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{process.base_url}/v1", api_key=api_key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def client(default_edge) -> openai.OpenAI:
    return sdk(default_edge)


def test_400_bad_request(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=0)
    error = caught.value
    assert (error.status_code, error.param, error.type) == (400, "max_tokens", "invalid_request_error")
    assert error.response.headers["content-type"] == "application/json"
    assert error.response.headers["x-request-id"]


def test_401_without_a_valid_key(default_worker, tmp_path):
    with edge([default_worker.address], tmp_path, "--api-keys", KEYS) as keyed:
        for key in ("unused", "sk-e2e-on", "sk-e2e-one2"):
            with pytest.raises(openai.AuthenticationError) as caught:
                sdk(keyed, key).chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=1)
            assert caught.value.status_code == 401 and caught.value.code == "invalid_api_key"
            assert caught.value.type == "invalid_request_error"
        with pytest.raises(openai.AuthenticationError):
            sdk(keyed, "unused").models.list()
        assert [m.id for m in sdk(keyed, "sk-e2e-two").models.list().data] == [MODEL]
        reply = sdk(keyed, "sk-e2e-one").chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=1)
        assert reply.usage.completion_tokens == 1
        assert httpx.get(f"{keyed.base_url}/health").status_code == 200
        assert httpx.get(f"{keyed.base_url}/ready").status_code == 200
    assert "sk-e2e" not in keyed.log_path.read_text()


def test_404_unknown_model_and_route(client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="no-such-model", messages=QUESTION)
    assert caught.value.code == "model_not_found" and caught.value.param == "model"
    # The worker said so: its id is on the answer.
    assert caught.value.response.headers["x-sluice-worker-id"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x")
    with pytest.raises(openai.NotFoundError):
        client.get("/no/such/route", cast_to=object)


def test_413_body_too_large(default_worker, tmp_path):
    with edge([default_worker.address], tmp_path, "--max-body-bytes", "2048") as small:
        with pytest.raises(openai.APIStatusError) as caught:
            sdk(small).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "x" * 4000}]
            )
        assert type(caught.value) is openai.APIStatusError  # the SDK has no class of its own for 413
        assert caught.value.status_code == 413 and caught.value.code == "request_too_large"


def test_422_body_not_an_object(client):
    with pytest.raises(openai.UnprocessableEntityError) as caught:
        client.post("/chat/completions", body=[{"model": MODEL, "messages": QUESTION}], cast_to=object)
    assert caught.value.status_code == 422 and caught.value.code == "invalid_type"
    with pytest.raises(openai.UnprocessableEntityError):
        client.post("/completions", body="just a string", cast_to=object)


def test_429_when_the_only_worker_is_full(model_cache, tmp_path, tokenizer):
    with (
        WorkerProcess(cache_dir=model_cache, log_dir=tmp_path, extra=BUSY) as busy_worker,
        edge([busy_worker.address], tmp_path) as busy_edge,
        httpx.Client(base_url=busy_edge.base_url, timeout=60) as http,
    ):
        # Special tokens (end of turn, end of text) banned (the fake passage has none either): both
        # requests keep generating until closed.
        never_end = {str(token): -100 for token in tokenizer.all_special_ids}
        long = {
            "model": MODEL,
            "messages": QUESTION,
            "max_tokens": 400,
            "stream": True,
            "logit_bias": never_end,
        }

        def metric(name: str) -> float:
            return busy_worker.metrics()[f"sluice_worker_{name}"]

        def until(condition) -> None:
            deadline = time.monotonic() + 30
            while not condition():
                assert time.monotonic() < deadline, "the worker never reached the expected state"
                time.sleep(0.05)

        with contextlib.ExitStack() as streams:
            running = streams.enter_context(http.stream("POST", "/v1/chat/completions", json=long))
            assert running.status_code == 200
            until(lambda: metric("running_requests") == 1)  # it holds the only running slot
            queued = streams.enter_context(http.stream("POST", "/v1/chat/completions", json=long))
            assert queued.status_code == 200  # accepted into the one queue place
            until(lambda: metric("queue_depth") == 1)
            with pytest.raises(openai.RateLimitError) as caught:
                sdk(busy_edge).chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=1)
            assert metric("running_requests") == 1 and metric("queue_depth") == 1
        error = caught.value
        assert error.status_code == 429 and error.type == "rate_limit_error"
        assert int(error.response.headers["retry-after"]) >= 1
        assert error.response.headers["x-sluice-worker-id"]


def test_503_when_no_worker_is_reachable(tmp_path):
    with edge([f"127.0.0.1:{free_port()}"], tmp_path, "--worker-connect-timeout", "2") as lonely:
        with pytest.raises(openai.InternalServerError) as caught:
            sdk(lonely).chat.completions.create(model=MODEL, messages=QUESTION)
        error = caught.value
        assert error.status_code == 503 and error.type == "server_error"
        assert int(error.response.headers["retry-after"]) >= 1
        assert "x-sluice-worker-id" not in error.response.headers  # no worker was reached
        with pytest.raises(openai.InternalServerError):
            sdk(lonely).models.list()


def test_headers_in_both_modes(default_edge):
    url = f"{default_edge.base_url}/v1/chat/completions"
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 1}
    plain = httpx.post(url, json=body, headers={"X-Request-ID": "trace-1"}, timeout=60)
    assert plain.headers["content-type"] == "application/json"
    assert plain.headers["x-request-id"] == "trace-1" and plain.headers["x-sluice-worker-id"]
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as stream:
        assert stream.headers["content-type"] == "text/event-stream"
        assert stream.headers["x-request-id"].startswith("req_") and stream.headers["x-sluice-worker-id"]
        assert stream.read().endswith(b"data: [DONE]\n\n")
    # A caller's id that is not header-safe is replaced, not echoed.
    odd = httpx.post(url, json={**body, "n": 0}, headers={"X-Request-ID": "bad id"}, timeout=60)
    assert odd.status_code == 400 and odd.headers["x-request-id"].startswith("req_")
    assert json.loads(odd.text)["error"]["param"] == "n"
