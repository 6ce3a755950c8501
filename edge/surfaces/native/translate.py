"""Worker events → the native API (``/api/v1/chat``): named events (model load, prompt
processing, one segment per run of same-kind output, tool-call verdicts, ``chat.end``) or the
result body for ``stream: false``. docs/edge-internals.md, "Native translation".
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from edge.errors import EdgeError
from edge.requests.errors import native_error
from edge.surfaces.shared.finish import finish_names
from edge.surfaces.shared.segments import Segments
from edge.surfaces.shared.usage import UsageTracker
from sluice.v1 import worker_pb2

_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,),
    "array": (list,),
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "null": (type(None),),
}


def schema_errors(value: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    """What is wrong with ``value`` under a JSON Schema's common keywords (``type``,
    ``enum``, ``required``, ``properties``, ``additionalProperties: false``, ``items``);
    other keywords are not checked. Empty when ``value`` fits."""
    where = path or "arguments"
    expected = schema.get("type")
    if isinstance(expected, str) and expected in _JSON_TYPES:
        fits = isinstance(value, _JSON_TYPES[expected])
        if isinstance(value, bool) and expected in ("integer", "number"):
            fits = False
        if expected == "integer" and isinstance(value, float):
            fits = value.is_integer()
        if not fits:
            return [f"{where} must be of type {expected}"]
    if "enum" in schema and value not in schema["enum"]:
        return [f"{where} must be one of {schema['enum']}"]
    errors: list[str] = []
    if isinstance(value, dict):
        properties = schema.get("properties") or {}
        errors += [
            f"{where}.{name} is required" for name in schema.get("required") or () if name not in value
        ]
        for name, item in value.items():
            if name in properties and isinstance(properties[name], dict):
                errors += schema_errors(item, properties[name], f"{where}.{name}")
            elif name not in properties and schema.get("additionalProperties") is False:
                errors.append(f"{where}.{name} is not an allowed property")
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            errors += schema_errors(item, schema["items"], f"{where}[{i}]")
    return errors


@dataclass
class _ToolCall:
    name: str
    parts: list[str] = field(default_factory=list)


@dataclass
class NativeTranslator:
    """Turns one call's events into native stream events and the final result
    (docs/edge-internals.md, "Native translation").

    ``tools`` maps each offered tool's name to its parameter schema (``None``: no schema).
    """

    response_id: str
    model_instance_id: str
    tools: dict[str, dict[str, Any] | None]
    usage: UsageTracker = field(default_factory=UsageTracker)
    _output: list[dict[str, Any]] = field(default_factory=list)
    _segments: Segments = field(default_factory=Segments)  # "reasoning", "message", "tool_call"
    _text: list[str] = field(default_factory=list)
    _call: _ToolCall | None = None
    _prompt_open: bool = False
    _loading: bool = False
    _finished: worker_pb2.Finished | None = None

    # ------------------------------------------------------------ stream

    def on_event(self, call: int, event: worker_pb2.GenerateResponse) -> list[dict[str, Any]]:
        """The stream events for one worker event, in wire order (possibly none)."""
        kind = event.WhichOneof("event")
        self.usage.on_event(call, event, kind)
        if kind == "progress":
            return self._progress(event.progress)
        events = self._end_load()
        if kind == "started":
            # A stream that began with a model load had only the requested name, maybe none.
            self.model_instance_id = self.model_instance_id or event.started.model
            self._prompt_open = True
            return [
                *events,
                {"type": "chat.start", "model_instance_id": self.model_instance_id},
                {"type": "prompt_processing.start"},
            ]
        if kind == "content":
            events += self._delta("message", event.content.text)
        elif kind == "refusal":
            events += self._delta("message", event.refusal.text)
        elif kind == "reasoning":
            events += self._delta("reasoning", event.reasoning.text)
        elif kind == "tool_call":
            events += self._tool_call(event.tool_call)
        elif kind == "finished":
            self._finished = event.finished
            events += self._end_prompt()
        return events

    def add(self, call: int, event: worker_pb2.GenerateResponse) -> None:
        """Records one event for a non-streamed answer (:meth:`result`)."""
        self.on_event(call, event)

    def finish(self) -> list[dict[str, Any]]:
        """After the last event: the open segment's end, then ``chat.end``."""
        events = self._end_prompt() + self._close()
        events.append({"type": "chat.end", "result": self.result()})
        return events

    def on_error(self, error: EdgeError) -> list[dict[str, Any]]:
        """A failure: ``error``, then ``chat.end`` with what was generated."""
        events = self._close()
        events.append({"type": "error", "error": native_error(error)})
        events.append({"type": "chat.end", "result": self.result()})
        return events

    # ------------------------------------------------------------ result

    def result(self) -> dict[str, Any]:
        """The non-streaming body (also ``chat.end``'s ``result``)."""
        self._close()
        totals = self.usage.final()
        timings = self._finished.timings if self._finished is not None else worker_pb2.Timings()
        output_tokens = totals["completion_tokens"]
        decode = timings.decode_seconds
        # Tokens after the first over the time between the first and the last.
        rate = (output_tokens - 1) / decode if decode > 0 and output_tokens > 1 else 0.0
        reason = self._finished.reason if self._finished is not None else worker_pb2.STOP
        return {
            "model_instance_id": self.model_instance_id,
            "output": list(self._output),
            "stats": {
                "input_tokens": totals["prompt_tokens"],
                "total_output_tokens": output_tokens,
                "reasoning_output_tokens": totals["completion_tokens_details"]["reasoning_tokens"],
                "tokens_per_second": round(rate, 3),
                "time_to_first_token_seconds": round(timings.time_to_first_token_seconds, 3),
            },
            "stop_reason": finish_names(reason).native,
            "response_id": self.response_id,
        }

    # ----------------------------------------------------------- helpers

    def _progress(self, progress: worker_pb2.Progress) -> list[dict[str, Any]]:
        events: list[dict[str, Any]]
        fraction = round(min(max(progress.fraction, 0.0), 1.0), 4)
        if progress.stage == worker_pb2.Progress.MODEL_LOAD:
            starting = not self._loading
            self._loading = True
            events = (
                [{"type": "model_load.start", "model_instance_id": self.model_instance_id}]
                if starting
                else []
            )
            events.append(
                {
                    "type": "model_load.progress",
                    "model_instance_id": self.model_instance_id,
                    "progress": fraction,
                }
            )
            return events
        events = self._end_load()
        if progress.stage == worker_pb2.Progress.PROMPT_PROCESSING and self._prompt_open:
            events.append({"type": "prompt_processing.progress", "progress": fraction})
        return events

    def _end_load(self) -> list[dict[str, Any]]:
        if not self._loading:
            return []
        self._loading = False
        return [{"type": "model_load.end", "model_instance_id": self.model_instance_id}]

    def _end_prompt(self) -> list[dict[str, Any]]:
        if not self._prompt_open:
            return []
        self._prompt_open = False
        return [{"type": "prompt_processing.end"}]

    def _delta(self, segment: str, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        events = self._end_prompt()
        if self._segments.opens(segment):
            events += self._close()
            self._segments.begin(segment)
            events.append({"type": f"{segment}.start"})
        self._text.append(text)
        events.append({"type": f"{segment}.delta", "content": text})
        return events

    def _tool_call(self, delta: worker_pb2.ToolCallDelta) -> list[dict[str, Any]]:
        events = self._end_prompt()
        if self._segments.opens("tool_call", delta.tool_index):
            events += self._close()
            self._segments.begin("tool_call", delta.tool_index)
            self._call = _ToolCall(delta.name)
            events.append({"type": "tool_call.start", "tool": delta.name})
        if self._call is not None and delta.arguments:
            self._call.parts.append(delta.arguments)
        return events

    def _close(self) -> list[dict[str, Any]]:
        """Ends the open segment: ``<segment>.end``, or a tool call's verdict; records its output item."""
        segment = self._segments.kind
        if not self._segments.close() or segment is None:
            return []
        if segment == "tool_call":
            call, self._call = self._call, None
            return self._judge(call) if call is not None else []
        text, self._text = "".join(self._text), []
        self._output.append({"type": segment, "content": text})
        return [{"type": f"{segment}.end"}]

    def _judge(self, call: _ToolCall) -> list[dict[str, Any]]:
        """``tool_call.arguments`` for a valid call, else ``tool_call.failure``."""
        text = "".join(call.parts)
        if call.name not in self.tools:
            return self._failure(f"Cannot find tool with name {call.name}.", "invalid_name", call.name, None)
        try:
            arguments = json.loads(text) if text.strip() else {}
        except ValueError:
            return self._failure(
                f"The arguments of {call.name} are not valid JSON.", "invalid_arguments", call.name, None
            )
        if not isinstance(arguments, dict):
            return self._failure(
                f"The arguments of {call.name} are not a JSON object.", "invalid_arguments", call.name, None
            )
        schema = self.tools[call.name]
        problems = schema_errors(arguments, schema) if schema else []
        if problems:
            return self._failure(
                f"Invalid arguments for {call.name}: {'; '.join(problems)}.",
                "invalid_arguments",
                call.name,
                arguments,
            )
        self._output.append({"type": "tool_call", "tool": call.name, "arguments": arguments})
        return [{"type": "tool_call.arguments", "tool": call.name, "arguments": arguments}]

    def _failure(
        self, reason: str, kind: str, name: str, arguments: dict[str, Any] | None
    ) -> list[dict[str, Any]]:
        metadata: dict[str, Any] = {"type": kind, "tool_name": name}
        if arguments is not None:
            metadata["arguments"] = arguments
        self._output.append({"type": "invalid_tool_call", "reason": reason, "metadata": metadata})
        return [{"type": "tool_call.failure", "reason": reason, "metadata": metadata}]
