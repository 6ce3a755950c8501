"""The HTTP API fuzzed from its own OpenAPI document (``/openapi.json``) with schemathesis.

A real edge in front of a real worker: a ``--fake-tokens`` worker for most of
the examples (the model does not matter to the API's shape and it is fast),
and a short run against the default model. Positive examples fit the document,
negative ones break it somewhere (a type, a bound, a missing field, a header);
both, streaming and not. Every answer must be a 2xx that conforms to the
document or a 4xx with the OpenAI error body (:func:`check_answer`): never a
5xx, a traceback or a hang; afterwards a normal request still succeeds.

Positive examples are steered a little so they reach the model: the served
model's name, and a completion length small enough to keep the run short
(lengths beyond the context are kept: they are the worker's 400s). The run
prints its figures (requests, statuses per operation and mode, time);
``SLUICE_FUZZ_SCALE`` multiplies the example counts (``make fuzz``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import Case, GenerationMode

from tests.fuzz.http_checks import (
    ANSWER_TIMEOUT_S,
    MODEL,
    Tally,
    check_answer,
    chunk_schema,
    examples,
    load_api,
)
from tests.processes import EdgeProcess, WorkerProcess

pytestmark = pytest.mark.integration

# (path, method, examples per mode at scale 1): about 380 requests, and 12 to the default model.
OPERATIONS = [
    ("/v1/chat/completions", "POST", 50),
    ("/v1/completions", "POST", 40),
    ("/v1/models", "GET", 5),
    ("/v1/models/{model_id}", "GET", 10),
    # Responses: created (stored, background, continued, on a conversation: made-up ids are 400s
    # and 404s), and stored ones read with made-up ids and paging parameters (never a 5xx).
    ("/v1/responses", "POST", 5),
    ("/v1/responses/{response_id}", "GET", 5),
    ("/v1/responses/{response_id}", "DELETE", 5),
    ("/v1/responses/{response_id}/cancel", "POST", 5),
    ("/v1/responses/{response_id}/input_items", "GET", 5),
    # Conversations: made-up bodies, ids and pages (200s, 404s and 400s, never a 5xx).
    ("/v1/conversations", "POST", 5),
    ("/v1/conversations/{conversation_id}", "GET", 3),
    ("/v1/conversations/{conversation_id}", "POST", 3),
    ("/v1/conversations/{conversation_id}", "DELETE", 3),
    ("/v1/conversations/{conversation_id}/items", "GET", 3),
    ("/v1/conversations/{conversation_id}/items", "POST", 3),
    ("/v1/conversations/{conversation_id}/items/{item_id}", "GET", 3),
    ("/v1/conversations/{conversation_id}/items/{item_id}", "DELETE", 3),
    # The Batch API: made-up ids, bodies and pages (404s, 400s and empty lists, never a 5xx).
    ("/v1/batches", "POST", 5),
    ("/v1/batches", "GET", 5),
    ("/v1/batches/{batch_id}", "GET", 3),
    ("/v1/batches/{batch_id}/cancel", "POST", 3),
    ("/v1/files", "POST", 5),
    ("/v1/files", "GET", 5),
    ("/v1/files/{file_id}", "GET", 3),
    ("/v1/files/{file_id}", "DELETE", 3),
    ("/v1/files/{file_id}/content", "GET", 3),
]
MODES = [GenerationMode.POSITIVE, GenerationMode.NEGATIVE]
# Completion lengths above this (and within any context) are lowered to it in positive examples.
FAKE_MAX_TOKENS = 8
REAL_MAX_TOKENS = 4
# With the default model: prompts (and message contents) cut to this many characters or ids,
# and a longer wait for an answer.
MAX_PROMPT = 64
REAL_ANSWER_TIMEOUT_S = 180.0
TOKEN_FIELDS = ("max_tokens", "max_completion_tokens")


def steer(
    case: Case, mode: GenerationMode, max_tokens: int, max_fanout: int | None = None, fake: bool = False
) -> None:
    """Points a positive example at the served model and keeps its completion short; with
    ``max_fanout``, also at most that many choices and prompts (a real model is slow). With
    ``fake`` (a ``--fake-tokens`` worker, which refuses to score a prompt with a 400), no ``echo``
    with ``logprobs``, so positive cases stay positive: the default-model run covers prompt logprobs."""
    if not isinstance(case.body, dict):
        return
    if fake and case.body.get("echo") is True and case.body.get("logprobs") is not None:
        del case.body["echo"]
    if all(case.body.get(name) is None for name in TOKEN_FIELDS):
        case.body["max_tokens"] = max_tokens  # unset would run to the end of the context
    if mode is not GenerationMode.POSITIVE:
        return
    case.body["model"] = MODEL
    if max_fanout is not None:
        if isinstance(case.body.get("n"), int) and case.body["n"] > max_fanout:
            case.body["n"] = max_fanout
        prompt = case.body.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = case.body["prompt"] = prompt[:max_fanout]
        # Short prompts: a long one takes the default model minutes on a busy machine.
        if isinstance(prompt, str | list):
            case.body["prompt"] = _shorten(prompt)
        for message in case.body.get("messages") or ():
            if isinstance(message, dict) and isinstance(message.get("content"), str):
                message["content"] = message["content"][:MAX_PROMPT]
    if case.body.get("best_of") is not None:  # only best_of == n is served (docs/http.md)
        case.body["best_of"] = case.body.get("n") or 1
    for name in TOKEN_FIELDS:
        value = case.body.get(name)
        if isinstance(value, int) and max_tokens < value <= 100_000:
            case.body[name] = max_tokens


def _shorten(prompt: str | list[Any]) -> str | list[Any]:
    """A completions prompt with each text or id list cut to ``MAX_PROMPT``."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        return [part[:MAX_PROMPT] for part in prompt]
    return prompt[:MAX_PROMPT]


def fuzz(
    api: Any,
    base_url: str,
    tally: Tally,
    path: str,
    method: str,
    mode: GenerationMode,
    count: int,
    max_tokens: int,
    max_fanout: int | None = None,
    fake: bool = False,
    timeout: float = ANSWER_TIMEOUT_S,
) -> None:
    operation = api[path][method]
    answers = api.raw_schema["paths"][path].get("post", {}).get("responses", {}).get("200", {})
    streams = method == "POST" and "text/event-stream" in answers.get("content", {})
    sse = chunk_schema(api.raw_schema, path) if streams else None

    @settings(
        max_examples=count,
        deadline=None,
        database=None,
        phases=[Phase.explicit, Phase.generate],  # no shrinking: each example is a real request
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def one(case: Case) -> None:
        steer(case, mode, max_tokens, max_fanout, fake)
        response = case.call(base_url=base_url, timeout=timeout)
        tally.add(f"{method} {path}", mode.value, response.status_code)
        check_answer(case, response, sse)

    one()


def still_serves(client: httpx.Client, base_url: str) -> None:
    """A plain chat completion after the fuzzing gets a 200 with a finished choice."""
    reply = client.post(
        f"{base_url}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3},
        timeout=ANSWER_TIMEOUT_S,
    )
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["finish_reason"] in ("stop", "length")


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    """One client for the module's plain requests (56 checks that the edge still serves), instead
    of a client and a connection made for each."""
    with httpx.Client() as shared:
        yield shared


@pytest.fixture(scope="module")
def tally() -> Iterator[Tally]:
    counts = Tally()
    yield counts
    print(f"\nHTTP fuzzing: {counts.report()}")


@pytest.fixture(scope="module")
def fake_edge(model_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EdgeProcess]:
    with (
        WorkerProcess(
            cache_dir=model_cache,
            log_dir=tmp_path_factory.mktemp("fuzz-fake-worker"),
            extra=["--fake-tokens", "--max-running", "32", "--default-max-tokens", str(FAKE_MAX_TOKENS)],
        ) as worker,
        EdgeProcess([worker.address], log_dir=tmp_path_factory.mktemp("fuzz-fake-edge")) as edge,
    ):
        yield edge


@pytest.fixture(scope="module")
def api(fake_edge: EdgeProcess) -> Any:
    """The edge's document, loaded once for every test here: it is built from the edge's routes
    alone (no worker's model or flags), so the default-model edge serves the same one."""
    return load_api(fake_edge.base_url)


@pytest.mark.parametrize("mode", MODES, ids=lambda mode: mode.value)
@pytest.mark.parametrize(("path", "method", "count"), OPERATIONS, ids=[f"{m} {p}" for p, m, _ in OPERATIONS])
def test_fuzzed_requests_get_a_conforming_answer(
    api: Any,
    fake_edge: EdgeProcess,
    client: httpx.Client,
    tally: Tally,
    path: str,
    method: str,
    count: int,
    mode: GenerationMode,
) -> None:
    fuzz(api, fake_edge.base_url, tally, path, method, mode, examples(count), FAKE_MAX_TOKENS, fake=True)
    still_serves(client, fake_edge.base_url)


@pytest.mark.parametrize("mode", MODES, ids=lambda mode: mode.value)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_fuzzed_requests_against_the_default_model(
    api: Any, default_edge: EdgeProcess, client: httpx.Client, tally: Tally, path: str, mode: GenerationMode
) -> None:
    fuzz(
        api,
        default_edge.base_url,
        tally,
        path,
        "POST",
        mode,
        examples(3),
        REAL_MAX_TOKENS,
        2,
        timeout=REAL_ANSWER_TIMEOUT_S,
    )
    still_serves(client, default_edge.base_url)
