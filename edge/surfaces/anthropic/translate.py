"""Worker events → Anthropic Messages: its stream events (``message_start``, one content block
per run of same-kind deltas, ``message_delta``, ``message_stop``; an ``error`` event after a
failure) or the message for ``stream: false``. docs/edge-internals.md, "Anthropic translation".
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from edge.errors import EdgeError
from edge.requests.errors import anthropic_error
from edge.surfaces.shared.finish import finish_names
from edge.surfaces.shared.ids import new_id
from edge.surfaces.shared.segments import Segments
from edge.surfaces.shared.usage import UsageTracker
from sluice.v1 import worker_pb2

IdFactory = Callable[[str], str]


def stop_reason(finished: worker_pb2.Finished | None) -> tuple[str, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence`` for a finished choice."""
    if finished is None:
        return "end_turn", None
    name = finish_names(finished.reason).anthropic
    if name == "end_turn" and finished.matched_stop:
        return "stop_sequence", finished.matched_stop
    return name, None


def parse_input(arguments: str) -> dict[str, Any]:
    """A tool call's ``input``: its arguments as a JSON object (docs/edge-internals.md, "Anthropic
    translation")."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return {"_raw_arguments": arguments}
    return value if isinstance(value, dict) else {"_raw_arguments": arguments}


@dataclass
class _Block:
    kind: str  # "text", "thinking", "tool_use"
    tool_index: int | None = None
    id: str = ""
    name: str = ""
    parts: list[str] = field(default_factory=list)


@dataclass
class MessagesTranslator:
    """Turns one call's events into Anthropic stream events and the final message
    (docs/edge-internals.md, "Anthropic translation")."""

    message_id: str
    model: str
    new_id: IdFactory = new_id
    usage: UsageTracker = field(default_factory=UsageTracker)
    _blocks: list[_Block] = field(default_factory=list)
    _segments: Segments = field(default_factory=Segments)
    _finished: worker_pb2.Finished | None = None

    # ------------------------------------------------------------ stream

    def on_event(self, call: int, event: worker_pb2.GenerateResponse) -> list[dict[str, Any]]:
        """The stream events for one worker event, in wire order (possibly none)."""
        kind = event.WhichOneof("event")
        self.usage.on_event(call, event, kind)
        if kind == "content":
            return self._text("text", "text_delta", "text", event.content.text)
        if kind == "reasoning":
            return self._text("thinking", "thinking_delta", "thinking", event.reasoning.text)
        if kind == "refusal":
            return self._text("text", "text_delta", "text", event.refusal.text)
        if kind == "tool_call":
            return self._tool_call(event.tool_call)
        if kind == "started":
            return [{"type": "message_start", "message": self._message([], None, None)}]
        if kind == "finished":
            self._finished = event.finished
        return []

    def add(self, call: int, event: worker_pb2.GenerateResponse) -> None:
        """Records one event for a non-streamed answer (:meth:`result`)."""
        self.on_event(call, event)

    def finish(self) -> list[dict[str, Any]]:
        """After the last event: the open block's ``content_block_stop``, ``message_delta``,
        ``message_stop``."""
        events = self._close()
        reason, sequence = stop_reason(self._finished)
        # Cumulative totals, as Anthropic sends them: the prompt's split may only be final now.
        usage = self._message([], None, None, final=True)["usage"]
        events.append(
            {
                "type": "message_delta",
                "delta": {"stop_reason": reason, "stop_sequence": sequence},
                "usage": usage,
            }
        )
        events.append({"type": "message_stop"})
        return events

    def on_error(self, error: EdgeError) -> list[dict[str, Any]]:
        """A failure after the stream began: Anthropic's ``error`` event."""
        return [anthropic_error(error)]

    # ------------------------------------------------------------ result

    def result(self) -> dict[str, Any]:
        """The message for ``stream: false``."""
        reason, sequence = stop_reason(self._finished)
        return self._message([self._render(block) for block in self._blocks], reason, sequence, final=True)

    def _message(
        self, content: list[dict[str, Any]], reason: str | None, sequence: str | None, final: bool = False
    ) -> dict[str, Any]:
        totals = self.usage.final() if final else self.usage.running()
        cached = totals["prompt_tokens_details"]["cached_tokens"]
        return {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": {
                "input_tokens": totals["prompt_tokens"] - cached,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": cached,
                "output_tokens": totals["completion_tokens"] if final else 0,
            },
        }

    @staticmethod
    def _render(block: _Block) -> dict[str, Any]:
        text = "".join(block.parts)
        if block.kind == "text":
            return {"type": "text", "text": text}
        if block.kind == "thinking":
            return {"type": "thinking", "thinking": text, "signature": ""}
        return {"type": "tool_use", "id": block.id, "name": block.name, "input": parse_input(text)}

    # ----------------------------------------------------------- helpers

    def _text(self, kind: str, delta_type: str, key: str, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        events: list[dict[str, Any]] = []
        if self._segments.opens(kind):
            events += self._close()
            events.append(self._start(_Block(kind)))
        self._blocks[-1].parts.append(text)
        events.append(
            {
                "type": "content_block_delta",
                "index": len(self._blocks) - 1,
                "delta": {"type": delta_type, key: text},
            }
        )
        return events

    def _tool_call(self, delta: worker_pb2.ToolCallDelta) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self._segments.opens("tool_use", delta.tool_index):
            events += self._close()
            block = _Block("tool_use", delta.tool_index, delta.id or self.new_id("toolu"), delta.name)
            events.append(self._start(block))
        if delta.arguments:
            self._blocks[-1].parts.append(delta.arguments)
            events.append(
                {
                    "type": "content_block_delta",
                    "index": len(self._blocks) - 1,
                    "delta": {"type": "input_json_delta", "partial_json": delta.arguments},
                }
            )
        return events

    def _start(self, block: _Block) -> dict[str, Any]:
        self._blocks.append(block)
        self._segments.begin(block.kind, block.tool_index)
        if block.kind == "text":
            content: dict[str, Any] = {"type": "text", "text": ""}
        elif block.kind == "thinking":
            content = {"type": "thinking", "thinking": "", "signature": ""}
        else:
            content = {"type": "tool_use", "id": block.id, "name": block.name, "input": {}}
        return {"type": "content_block_start", "index": len(self._blocks) - 1, "content_block": content}

    def _close(self) -> list[dict[str, Any]]:
        if not self._segments.close():
            return []
        return [{"type": "content_block_stop", "index": len(self._blocks) - 1}]
