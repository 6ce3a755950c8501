"""Structured logs: the JSON format, and one request id in the edge's and the worker's logs.

The first tests check :mod:`sluice.logs` in-process; the last one runs a real
worker (the tiny random model) and a real edge with ``--log-format json``.
"""

from __future__ import annotations

import io
import json
import logging
import re
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from sluice.logs import make_handler, request_id_var
from tests.processes import EdgeProcess, WorkerProcess


def emit(fmt: str, worker_id: str | None = None, **kwargs: Any) -> str:
    """What one record logged through a fresh handler looks like."""
    stream = io.StringIO()
    logger = logging.getLogger(f"sluice.test.{uuid.uuid4().hex}")
    logger.propagate = False
    logger.addHandler(make_handler(fmt, worker_id=worker_id, stream=stream))
    logger.setLevel(logging.DEBUG)
    try:
        raise ValueError("boom")
    except ValueError:
        logger.warning("hello %s", kwargs.pop("arg", "world"), exc_info=kwargs.pop("exc", False), **kwargs)
    return stream.getvalue()


def test_json_lines_carry_time_level_logger_message_and_the_context_request_id() -> None:
    token = request_id_var.set("req-123")
    try:
        line = emit("json", worker_id="w-1")
    finally:
        request_id_var.reset(token)
    assert line.endswith("\n") and line.count("\n") == 1
    entry = json.loads(line)
    assert entry["level"] == "WARNING" and entry["logger"].startswith("sluice.test.")
    assert entry["message"] == "hello world"
    assert (entry["request_id"], entry["worker_id"]) == ("req-123", "w-1")
    assert entry["time"].endswith("Z") and "T" in entry["time"]
    outside = json.loads(emit("json"))
    assert "request_id" not in outside and "worker_id" not in outside


def test_json_keeps_tracebacks_odd_arguments_and_an_explicit_request_id() -> None:
    entry = json.loads(emit("json", exc=True, arg=object(), extra={"request_id": "explicit"}))
    assert "ValueError: boom" in entry["exception"] and entry["request_id"] == "explicit"
    assert entry["message"].startswith("hello <object object")
    multi = json.loads(emit("json", arg="two\nlines"))  # still one line on the wire
    assert multi["message"] == "hello two\nlines"


def test_text_format_is_the_classic_one_and_unknown_formats_are_refused() -> None:
    line = emit("text")
    assert " WARNING sluice.test." in line and line.rstrip().endswith(": hello world")
    with pytest.raises(ValueError, match="xml"):
        make_handler("xml")


# ------------------------------------------------------------------ real processes


def json_lines(path: Path) -> list[dict[str, Any]]:
    """The log's JSON lines; any line that is not JSON must not come from our loggers."""
    entries = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            entries.append(json.loads(line))
        else:
            # Third-party output written straight to stderr (progress bars, gRPC's C core).
            assert " sluice." not in line and " worker." not in line, line
    return entries


@pytest.fixture(scope="module")
def json_services(
    model_cache: Path, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[WorkerProcess, EdgeProcess]]:
    log_dir = tmp_path_factory.mktemp("json-logs")
    worker_extra = ["--log-format", "json", "--worker-id", "worker-json-1"]
    with (
        WorkerProcess(
            cache_dir=model_cache, log_dir=log_dir, model=str(tiny_model_dir), extra=worker_extra
        ) as worker,
        EdgeProcess(
            [worker.address], log_dir=log_dir, extra=["--log-format", "json", "--drain-delay", "0"]
        ) as edge,
    ):
        yield worker, edge


# The server's access line of a chat completion sent by httpx (hypercorn's format, edge/access_log.py).
ACCESS_LINE = (
    r'127\.0\.0\.1:\d+ - - \[[^]]+\] "POST /v1/chat/completions 1\.1" 200 (-|\d+) "-" '
    r'"python-httpx/[^"]+"'
)


def access_lines(edge: EdgeProcess) -> list[str]:
    """The edge's access lines of chat completions so far."""
    lines = (e["message"] for e in json_lines(edge.log_path) if e["logger"] == "sluice.edge.access")
    return [line for line in lines if re.fullmatch(ACCESS_LINE, line)]


@pytest.mark.integration
@pytest.mark.parametrize("stream", [False, True])
def test_one_request_id_in_the_edge_and_the_worker_logs(
    json_services: tuple[WorkerProcess, EdgeProcess], stream: bool
) -> None:
    worker, edge = json_services
    request_id = f"logs-{uuid.uuid4().hex}"
    access_before = len(access_lines(edge))
    model = httpx.get(f"{edge.base_url}/v1/models", timeout=10).json()["data"][0]["id"]
    response = httpx.post(
        f"{edge.base_url}/v1/chat/completions",
        json={
            "model": model,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 5,
            "stream": stream,
        },
        headers={"X-Request-ID": request_id},
        timeout=30,
    )
    assert response.status_code == 200 and response.headers["x-request-id"] == request_id

    def mine(path: Path) -> list[dict[str, Any]]:
        return [entry for entry in json_lines(path) if entry.get("request_id") == request_id]

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        worker_lines, edge_lines = mine(worker.log_path), mine(edge.log_path)
        if (
            any("completed" in e["message"] for e in worker_lines)
            and (not stream or any("stream" in e["message"] for e in edge_lines))
            and len(access_lines(edge)) > access_before  # written once the response has gone
        ):
            break
        time.sleep(0.1)
    print("edge:", *(e["message"] for e in edge_lines), sep="\n  ")
    print("worker:", *(e["message"] for e in worker_lines), sep="\n  ")

    # The edge: the answered request, and for a stream how it ended; the server's access line.
    assert any("POST /v1/chat/completions -> 200" in e["message"] for e in edge_lines)
    assert len(access_lines(edge)) == access_before + 1, access_lines(edge)
    if stream:
        assert any("stream completed" in e["message"] for e in edge_lines)
    # The worker: accepted and ended, with finish reason and tokens, and its own id on every line.
    accepted = [e for e in worker_lines if "accepted" in e["message"]]
    ended = [e for e in worker_lines if "completed" in e["message"]]
    assert len(accepted) == 1 and "prompt tokens" in accepted[0]["message"]
    assert len(ended) == 1
    # A random model may end early on its end-of-sequence token (very unlikely in 5 tokens).
    assert re.search(r"finish_reasons=(length|stop), completion_tokens=[1-5]\b", ended[0]["message"])
    assert all(e["worker_id"] == "worker-json-1" for e in json_lines(worker.log_path))
    for entry in (*edge_lines, *worker_lines):
        assert {"time", "level", "logger", "message"} <= entry.keys()
