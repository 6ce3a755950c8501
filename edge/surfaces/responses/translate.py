"""Worker events → the OpenAI Responses API: its typed stream events (each with a
``sequence_number``; one output item per run of same-kind deltas) or the Response object for
``stream: false``. docs/edge-internals.md, "Responses translation".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from edge.errors import EdgeError
from edge.surfaces.shared.finish import finish_names
from edge.surfaces.shared.ids import new_id
from edge.surfaces.shared.segments import Segments
from edge.surfaces.shared.usage import UsageTracker
from sluice.v1 import worker_pb2

IdFactory = Callable[[str], str]


def responses_usage(usage: dict[str, Any]) -> dict[str, Any]:
    """The Responses ``usage`` from the chat-shaped totals of a
    :class:`~edge.surfaces.shared.usage.UsageTracker`."""
    return {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {
            "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
            "cache_write_tokens": 0,
        },
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": usage["completion_tokens_details"]["reasoning_tokens"]},
        "total_tokens": usage["total_tokens"],
    }


@dataclass
class _Item:
    """The output item being streamed, and how its deltas are named."""

    index: int
    item: dict[str, Any]
    # For reasoning and message items: the open content part and its text so far.
    part: dict[str, Any] | None = None
    text: list[str] = field(default_factory=list)


@dataclass
class ResponsesTranslator:
    """Turns one call's events into Responses stream events and the final Response
    (docs/edge-internals.md, "Responses translation").

    ``echo`` holds the request fields a Response repeats
    (:meth:`~edge.surfaces.responses.request.ParsedResponsesRequest.echo`).
    """

    response_id: str
    created_at: int
    model: str
    echo: dict[str, Any]
    new_id: IdFactory = new_id
    usage: UsageTracker = field(default_factory=UsageTracker)
    _sequence: int = 0
    _output: list[dict[str, Any]] = field(default_factory=list)
    _current: _Item | None = None
    _segments: Segments = field(default_factory=Segments)
    _finish_reason: int = worker_pb2.FINISH_REASON_UNSPECIFIED

    # ------------------------------------------------------------ stream

    def on_event(self, call: int, event: worker_pb2.GenerateResponse) -> list[dict[str, Any]]:
        """The stream events for one worker event, in wire order (possibly none)."""
        kind = event.WhichOneof("event")
        self.usage.on_event(call, event, kind)
        if kind == "content":
            return self._text("message", "output_text", event.content.text)
        if kind == "reasoning":
            return self._text("reasoning", "reasoning_text", event.reasoning.text)
        if kind == "refusal":
            return self._text("message", "refusal", event.refusal.text)
        if kind == "tool_call":
            return self._tool_call(event.tool_call)
        if kind == "started":
            snapshot = self.response("in_progress", output=[])
            return [
                self._event("response.created", response=snapshot),
                self._event("response.in_progress", response=snapshot),
            ]
        if kind == "finished":
            self._finish_reason = event.finished.reason
        return []

    def add(self, call: int, event: worker_pb2.GenerateResponse) -> None:
        """Records one event for a non-streamed answer (:meth:`result`)."""
        self.on_event(call, event)

    def finish(self) -> list[dict[str, Any]]:
        """After the last event: the open item's closing events, then ``response.completed``
        (or ``response.incomplete``)."""
        status = self._status()
        events = self._close(status)
        name = "response.completed" if status == "completed" else "response.incomplete"
        events.append(self._event(name, response=self.result()))
        return events

    def on_error(self, error: EdgeError) -> list[dict[str, Any]]:
        """A failure after the stream began: ``error``, then ``response.failed`` with what
        was generated (the open item is closed as ``incomplete``)."""
        events = self._close(status="incomplete")
        events.append(self._event("error", code=error.code, message=error.message, param=error.param))
        failed = self.response("failed", output=list(self._output))
        failed["error"] = {"code": error.code or error.type, "message": error.message}
        failed["usage"] = responses_usage(self.usage.final())
        events.append(self._event("response.failed", response=failed))
        return events

    # ------------------------------------------------------------ result

    def result(self) -> dict[str, Any]:
        """The final Response object (``stream: false``, and ``response.completed``'s)."""
        self._close(self._status())
        response = self.response(self._status(), output=list(self._output))
        if response["status"] == "incomplete":
            response["incomplete_details"] = {"reason": finish_names(self._finish_reason).incomplete}
        response["usage"] = responses_usage(self.usage.final())
        return response

    def response(self, status: str, *, output: list[dict[str, Any]]) -> dict[str, Any]:
        """The Response object with ``status`` and ``output`` (``usage`` null until the end)."""
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": None,
            "model": self.model,
            "output": output,
            "previous_response_id": None,
            "store": False,
            "truncation": "disabled",
            "usage": None,
            **self.echo,
        }

    # ----------------------------------------------------------- helpers

    def _status(self) -> str:
        return "completed" if finish_names(self._finish_reason).incomplete is None else "incomplete"

    def _event(self, event_type: str, /, **fields: Any) -> dict[str, Any]:
        event = {"type": event_type, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def _text(self, item_type: str, part_type: str, text: str) -> list[dict[str, Any]]:
        """A text delta of a reasoning or message item (opening the item and part as needed)."""
        if not text:
            return []
        events: list[dict[str, Any]] = []
        current = self._current
        if current is None or self._segments.opens(item_type):
            events += self._close()
            current = self._open(self._new_item(item_type))
            events.append(self._added(current))
        if current.part is None or current.part["type"] != part_type:
            events += self._close_part(current)
            current.part = _empty_part(part_type)
            current.text = []
            events.append(
                self._event(
                    "response.content_part.added",
                    item_id=current.item["id"],
                    output_index=current.index,
                    content_index=len(current.item["content"]),
                    part=dict(current.part),
                )
            )
        current.text.append(text)
        delta: dict[str, Any] = {
            "item_id": current.item["id"],
            "output_index": current.index,
            "content_index": len(current.item["content"]),
            "delta": text,
        }
        if part_type == "output_text":
            delta["logprobs"] = []
        events.append(self._event(_DELTA_EVENTS[part_type], **delta))
        return events

    def _tool_call(self, delta: worker_pb2.ToolCallDelta) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        current = self._current
        if current is None or self._segments.opens("function_call", delta.tool_index):
            events += self._close()
            item = {
                "type": "function_call",
                "id": self.new_id("fc"),
                "call_id": delta.id or self.new_id("call"),
                "name": delta.name,
                "arguments": "",
                "status": "in_progress",
            }
            current = self._open(item, delta.tool_index)
            events.append(self._added(current))
        if delta.arguments:
            current.item["arguments"] += delta.arguments
            events.append(
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=current.item["id"],
                    output_index=current.index,
                    delta=delta.arguments,
                )
            )
        return events

    def _new_item(self, item_type: str) -> dict[str, Any]:
        if item_type == "reasoning":
            return {
                "type": "reasoning",
                "id": self.new_id("rs"),
                "summary": [],
                "content": [],
                "status": "in_progress",
            }
        return {
            "type": "message",
            "id": self.new_id("msg"),
            "status": "in_progress",
            "role": "assistant",
            "content": [],
        }

    def _open(self, item: dict[str, Any], tool_index: int | None = None) -> _Item:
        self._current = _Item(index=len(self._output), item=item)
        self._segments.begin(item["type"], tool_index)
        self._output.append(item)
        return self._current

    def _added(self, current: _Item) -> dict[str, Any]:
        snapshot = {**current.item}
        if "content" in snapshot:
            snapshot["content"] = []
        return self._event("response.output_item.added", output_index=current.index, item=snapshot)

    def _close_part(self, current: _Item) -> list[dict[str, Any]]:
        """Closes the open content part: ``<kind>.done``, ``content_part.done``."""
        part = current.part
        if part is None:
            return []
        text = "".join(current.text)
        part = {**part, _PART_TEXT_KEY[part["type"]]: text}
        content_index = len(current.item["content"])
        current.item["content"].append(part)
        current.part = None
        ids = {"item_id": current.item["id"], "output_index": current.index, "content_index": content_index}
        done: dict[str, Any] = {**ids, _PART_TEXT_KEY[part["type"]]: text}
        if part["type"] == "output_text":
            done["logprobs"] = []
        return [
            self._event(_DONE_EVENTS[part["type"]], **done),
            self._event("response.content_part.done", **ids, part=part),
        ]

    def _close(self, status: str = "completed") -> list[dict[str, Any]]:
        """Closes the open item, if any: its part's closing events, then ``output_item.done``."""
        current = self._current
        if current is None:
            return []
        self._current = None
        self._segments.close()
        events = self._close_part(current)
        if current.item["type"] == "function_call":
            events.append(
                self._event(
                    "response.function_call_arguments.done",
                    item_id=current.item["id"],
                    output_index=current.index,
                    name=current.item["name"],
                    arguments=current.item["arguments"],
                )
            )
        current.item["status"] = status
        events.append(
            self._event("response.output_item.done", output_index=current.index, item=dict(current.item))
        )
        return events


_DELTA_EVENTS = {
    "output_text": "response.output_text.delta",
    "reasoning_text": "response.reasoning_text.delta",
    "refusal": "response.refusal.delta",
}
_DONE_EVENTS = {
    "output_text": "response.output_text.done",
    "reasoning_text": "response.reasoning_text.done",
    "refusal": "response.refusal.done",
}
_PART_TEXT_KEY = {"output_text": "text", "reasoning_text": "text", "refusal": "refusal"}


def _empty_part(part_type: str) -> dict[str, Any]:
    if part_type == "output_text":
        return {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
    if part_type == "refusal":
        return {"type": "refusal", "refusal": ""}
    return {"type": "reasoning_text", "text": ""}
