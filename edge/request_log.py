"""Request logs (``--log-requests``): one JSON line per API request on stderr, with its ids, the API
key's id (never the key), model, token counts, timings and finish reasons, and with
``--log-request-text N`` the first N characters of prompt and output. docs/observability.md."""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from sluice.v1 import worker_pb2

#: The logger of the lines; its own handler writes each line as it is (no log format around it).
log = logging.getLogger("sluice.edge.request_log")


@dataclass
class RequestRecord:
    """What one request's log line says, filled in as the request runs."""

    request_id: str
    method: str
    path: str
    text_chars: int
    started_at: float = field(default_factory=time.monotonic)
    key_id: str | None = None
    status: int | None = None
    stream: bool = False
    model: str | None = None
    response_id: str | None = None
    worker_ids: list[str] = field(default_factory=list)
    usage: dict[str, int] = field(default_factory=dict)
    finish_reasons: list[str] = field(default_factory=list)
    first_output_s: float | None = None
    queue_s: float | None = None
    error: str | None = None
    prompt: str | None = None
    _output: list[str] = field(default_factory=list)
    _output_chars: int = 0

    def on_requests(self, requests: Sequence[worker_pb2.GenerateRequest]) -> None:
        """The model asked for and, with text, the start of the first prompt."""
        if requests:
            self.model = requests[0].model or self.model
            if self.text_chars:
                self.prompt = prompt_text(requests[0])[: self.text_chars]

    def on_event(self, call: int, event: worker_pb2.GenerateResponse) -> None:
        """One worker event of call ``call``: model, tokens, finish, the first output."""
        kind = event.WhichOneof("event")
        if kind == "started":
            self.model = event.started.model or self.model
            if event.started.worker_id and event.started.worker_id not in self.worker_ids:
                self.worker_ids.append(event.started.worker_id)
        elif kind in ("content", "reasoning", "tool_call", "refusal"):
            if self.first_output_s is None:
                self.first_output_s = time.monotonic() - self.started_at
            if kind == "content" and call == 0 and event.content.choice_index == 0:
                self._add_output(event.content.text)
        elif kind == "finished":
            self.finish_reasons.append(worker_pb2.FinishReason.Name(event.finished.reason).lower())
            if self.queue_s is None and event.finished.HasField("timings"):
                self.queue_s = event.finished.timings.queue_seconds
        elif kind == "usage":
            for name in ("prompt_tokens", "completion_tokens", "cached_tokens", "reasoning_tokens"):
                self.usage[name] = self.usage.get(name, 0) + getattr(event.usage, name)

    def _add_output(self, text: str) -> None:
        room = self.text_chars - self._output_chars
        if room > 0 and text:
            self._output.append(text[:room])
            self._output_chars += min(room, len(text))

    def line(self, outcome: str) -> str:
        """The JSON line, at the request's end (``outcome``: how it ended)."""
        entry: dict[str, Any] = {
            "time": datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "request_id": self.request_id,
            "response_id": self.response_id,
            "key_id": self.key_id,
            "method": self.method,
            "path": self.path,
            "status": self.status,
            "outcome": outcome,
            "error": self.error,
            "model": self.model,
            "stream": self.stream,
            "worker_ids": self.worker_ids,
            "prompt_tokens": self.usage.get("prompt_tokens"),
            "completion_tokens": self.usage.get("completion_tokens"),
            "cached_tokens": self.usage.get("cached_tokens"),
            "reasoning_tokens": self.usage.get("reasoning_tokens"),
            "finish_reasons": self.finish_reasons,
            "queue_s": _rounded(self.queue_s),
            "first_output_s": _rounded(self.first_output_s),
            "duration_s": _rounded(time.monotonic() - self.started_at),
        }
        if self.text_chars:
            entry["prompt"] = self.prompt
            entry["output"] = "".join(self._output) if self.prompt is not None else None
        return json.dumps(entry, ensure_ascii=False)


def _rounded(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 4)


def prompt_text(request: worker_pb2.GenerateRequest) -> str:
    """A worker request's prompt as text: a raw prompt as it is, chat messages as ``role: content``
    lines (image parts and token-id prompts left out)."""
    if request.WhichOneof("input") == "prompt":
        return request.prompt.text
    lines = []
    for message in request.chat.messages:
        text = message.content if message.HasField("content") else ""
        lines.append(f"{message.role}: {text}")
    return "\n".join(lines)


class RequestLogger:
    """Writes the lines (stderr, one JSON object each); ``text_chars`` of prompt and output (0: none)."""

    def __init__(self, text_chars: int, stream: Any = None) -> None:
        self.text_chars = text_chars
        if not any(getattr(h, "sluice_request_log", False) for h in log.handlers):
            handler = logging.StreamHandler(stream or sys.stderr)
            handler.setFormatter(logging.Formatter("%(message)s"))
            handler.sluice_request_log = True  # type: ignore[attr-defined]
            log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False

    def begin(self, request_id: str, method: str, path: str) -> RequestRecord:
        return RequestRecord(request_id, method, path, self.text_chars)

    def write(self, record: RequestRecord, outcome: str) -> None:
        log.info(record.line(outcome))
