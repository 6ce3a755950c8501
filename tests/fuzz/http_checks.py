"""What every HTTP answer to a fuzzed request must be, and the tally a fuzz run reports.

:func:`check_answer` accepts exactly: a 2xx that matches the edge's OpenAPI
document (a JSON body validated by schemathesis' conformance checks; a
``text/event-stream`` whose every ``data:`` chunk validates against the
document's chunk schema, or is an ``event: error`` with the OpenAI error body,
and which ends with ``data: [DONE]``), or a 4xx with the OpenAI error body.
Anything else fails the test: a 5xx, a traceback in a body, another status.
The one 5xx allowed is the documented 504 ``timeout`` of a request that set its
own deadline (``X-Sluice-Timeout``) and ran out of it before the answer began
(a slow model under load meets a generated deadline of a second or two).
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import jsonschema
import schemathesis
from schemathesis import Case
from schemathesis.checks import not_a_server_error
from schemathesis.core.transport import Response
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

MODEL = "SmolLM2-135M-Instruct"
# `make fuzz` raises it (SLUICE_FUZZ_SCALE=20); CI runs the default.
SCALE = float(os.environ.get("SLUICE_FUZZ_SCALE", "1"))
# A request that gets no complete answer in this time counts as a hang.
ANSWER_TIMEOUT_S = 60.0
ERROR_KEYS = {"message", "type", "param", "code"}
# The events that end a streamed Response (docs/http.md): its answer, whole, cut short or failed.
FINAL_EVENTS = {"response.completed", "response.incomplete", "response.failed"}


def load_api(base_url: str) -> Any:
    """The edge's document, from its own ``/openapi.json``, ready for schemathesis."""
    api = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    # schemathesis stops reading a stream after 20 events by default; read every stream to its end.
    api.config.max_stream_events = 1_000_000
    return api


def examples(base: int) -> int:
    """``base`` examples, scaled by ``SLUICE_FUZZ_SCALE``."""
    return max(1, round(base * SCALE))


@dataclass
class Tally:
    """Statuses seen per operation and mode, printed at the end of a run (docs/testing.md)."""

    statuses: Counter[tuple[str, str, int]] = field(default_factory=Counter)
    started: float = field(default_factory=time.monotonic)

    def add(self, operation: str, mode: str, status: int) -> None:
        self.statuses[(operation, mode, status)] += 1

    @property
    def total(self) -> int:
        return sum(self.statuses.values())

    def report(self) -> str:
        lines = [f"{self.total} requests in {time.monotonic() - self.started:.1f} s"]
        for (operation, mode, status), count in sorted(self.statuses.items()):
            lines.append(f"  {operation:28} {mode:8} {status}: {count}")
        return "\n".join(lines)


def content_type(response: Response) -> str:
    """The response's Content-Type ('' when absent); schemathesis keeps headers as lists."""
    for name, values in response.headers.items():
        if name.lower() == "content-type" and values:
            return values[0]
    return ""


def check_error_body(response: Response) -> None:
    assert content_type(response).startswith("application/json"), response.headers
    body = response.json()
    error = body["error"]
    assert set(error) >= ERROR_KEYS, body
    assert isinstance(error["message"], str) and error["message"], body
    assert isinstance(error["type"], str), body
    assert error["param"] is None or isinstance(error["param"], str), body
    assert "Traceback" not in response.text


def check_event_stream(response: Response, chunk_schema: dict[str, Any]) -> None:
    """Every ``data:`` is a chunk matching ``chunk_schema`` or (after ``event: error``) an error
    body; the stream ends with exactly one ``data: [DONE]``. A stream of named events (the
    Responses surface's, which sends no ``[DONE]``) is checked by :func:`check_named_events`."""
    assert not response.stream_cut_short
    validator = jsonschema.Draft202012Validator(chunk_schema)
    events = [event for event in response.text.split("\n\n") if event.strip()]
    assert events, "an empty stream"
    first = _content_lines(events[0])
    if first and first[0].startswith("event: ") and first[0] != "event: error":
        check_named_events(events, validator)
        return
    assert events[-1] == "data: [DONE]", f"no [DONE] at the end; the last events: {events[-2:]}"
    for event in events[:-1]:
        lines = _content_lines(event)
        if not lines:
            continue
        if lines[0] == "event: error":
            payload = json.loads(lines[1].removeprefix("data: "))
            assert set(payload["error"]) >= ERROR_KEYS, payload
            continue
        assert len(lines) == 1 and lines[0].startswith("data: {"), event
        chunk = json.loads(lines[0].removeprefix("data: "))
        errors = sorted(validator.iter_errors(chunk), key=str)
        assert not errors, f"{chunk}: {errors[0].message}"


def check_named_events(events: list[str], validator: jsonschema.Draft202012Validator) -> None:
    """Each event is ``event: <type>`` and ``data: <json>`` whose ``type`` is that name and which
    matches the chunk schema; the last one ends the response (:data:`FINAL_EVENTS`); no ``[DONE]``."""
    names = []
    for event in events:
        lines = _content_lines(event)
        if not lines:
            continue
        assert len(lines) == 2 and lines[0].startswith("event: ") and lines[1].startswith("data: {"), event
        name, payload = lines[0].removeprefix("event: "), json.loads(lines[1].removeprefix("data: "))
        assert payload.get("type") == name, event
        errors = sorted(validator.iter_errors(payload), key=str)
        assert not errors, f"{payload}: {errors[0].message}"
        names.append(name)
    assert names and names[-1] in FINAL_EVENTS, f"the stream ends with {names[-2:]}"


def _content_lines(event: str) -> list[str]:
    """An event's lines, its ``:`` comments (heartbeats) left out."""
    return [line for line in event.split("\n") if not line.startswith(":")]


def chunk_schema(document: dict[str, Any], path: str) -> dict[str, Any]:
    """The chunk schema of a streaming operation (``x-sse-data-schema``), resolvable on its own."""
    sse = document["paths"][path]["post"]["responses"]["200"]["content"]["text/event-stream"]
    return {"$ref": sse["x-sse-data-schema"]["$ref"], "components": document["components"]}


def check_answer(case: Case, response: Response, sse_schema: dict[str, Any] | None) -> None:
    """Fails unless ``response`` is a conforming 2xx or a 4xx with the OpenAI error body."""
    status = response.status_code
    if status == 504 and _asked_for_a_deadline(case):
        # The caller's own X-Sluice-Timeout passed before the answer began: the documented 504.
        check_error_body(response)
        assert response.json()["error"]["code"] == "timeout", response.text
        return
    assert status < 500, (
        f"{status} for {case.method} {case.formatted_path} {_describe(case)}: {response.text[:300]}"
    )
    if 400 <= status < 500:
        check_error_body(response)
    else:
        assert 200 <= status < 300, f"unexpected status {status}"
    if content_type(response).startswith("text/event-stream"):
        assert sse_schema is not None, "a stream from an operation that has none"
        try:
            check_event_stream(response, sse_schema)
        except AssertionError as error:
            raise AssertionError(f"{error}\nrequest: {_describe(case)}") from None
        return
    case.validate_response(
        response,
        checks=[
            not_a_server_error,
            status_code_conformance,
            content_type_conformance,
            response_schema_conformance,
        ],
    )


def _asked_for_a_deadline(case: Case) -> bool:
    return any(name.lower() == "x-sluice-timeout" for name in case.headers or {})


def _describe(case: Case) -> str:
    body = json.dumps(case.body, default=repr) if case.body is not None else ""
    return f"headers={case.headers} body={body[:2000]}"
