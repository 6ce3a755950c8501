"""Worker events → OpenAI chat completions: ``chat.completion.chunk`` dicts or one ``chat.completion``.

No I/O; ids and timestamps are passed in, so golden tests pin the exact dicts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from edge.surfaces.shared.chunks import ChunkStream
from edge.surfaces.shared.finish import finish_reason_name
from sluice.ids import new_tool_call_id
from sluice.v1 import worker_pb2


def logprob_entries(logprobs: Any) -> list[dict[str, Any]]:
    """Per-token OpenAI logprob objects (``bytes`` as a list of ints)."""
    return [
        {
            "token": lp.token,
            "logprob": lp.logprob,
            "bytes": list(lp.bytes),
            "top_logprobs": [
                {"token": top.token, "logprob": top.logprob, "bytes": list(top.bytes)}
                for top in lp.top_logprobs
            ],
        }
        for lp in logprobs
    ]


@dataclass
class _ChoiceState:
    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    refusal: list[str] = field(default_factory=list)
    tool_calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    refusal_logprobs: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class ChatTranslator(ChunkStream):
    """Turns the events of one chat call into chunks (:meth:`on_event`, then :meth:`finish`) or
    into the ``chat.completion`` (:meth:`add`, then :meth:`result`). The chunk rules are in
    docs/edge-internals.md, "Chat translation"; ``usage`` is always in the result.
    """

    system_fingerprint: str | None = None
    _announced: set[int] = field(default_factory=set)
    _tool_calls_seen: set[tuple[int, int]] = field(default_factory=set)
    _choices: dict[int, _ChoiceState] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._open_envelope(
            "chat.completion.chunk", system_fingerprint=self.system_fingerprint, service_tier=None
        )

    # ------------------------------------------------------------ stream

    def on_event(self, call: int, event: worker_pb2.GenerateResponse) -> list[dict[str, Any]]:
        """Chunks for one event, in wire order (possibly none); ``call`` is always 0."""
        kind = event.WhichOneof("event")
        self.usage.on_event(0, event, kind)
        if kind == "content":  # the most frequent event first
            delta = event.content
            text = delta.text
            if not text and not delta.logprobs:
                return []
            index = delta.choice_index
            lp = {"content": logprob_entries(delta.logprobs), "refusal": None} if self.logprobs else None
            # The role chunk (if this choice has none yet) is built after this one, but sent first.
            chunk = self._envelope.chunk(
                [{"index": index, "delta": {"content": text}, "logprobs": lp, "finish_reason": None}]
            )
            return [chunk] if index in self._announced else [self._role_chunk(index), chunk]
        if kind == "started":
            return [self._role_chunk(i) for i in range(max(1, event.started.n)) if i not in self._announced]
        if kind == "reasoning":
            if not event.reasoning.text:
                return []
            return self._delta(
                event.reasoning.choice_index, {"reasoning_content": event.reasoning.text}, None
            )
        if kind == "refusal":
            delta_r = event.refusal
            lp = {"content": None, "refusal": logprob_entries(delta_r.logprobs)} if self.logprobs else None
            return self._delta(delta_r.choice_index, {"refusal": delta_r.text}, lp)
        if kind == "tool_call":
            return self._delta(
                event.tool_call.choice_index, {"tool_calls": [self._tool_call(event.tool_call)]}, None
            )
        if kind == "finished":
            index = event.finished.choice_index
            chunks = self._announce(index)
            chunks.append(self._chunk([self._choice(index, {}, finish_reason_name(event.finished.reason))]))
            return chunks
        return []  # usage (see finish), progress (the heartbeat covers the silence), or a future event

    def _tool_call(self, delta: worker_pb2.ToolCallDelta) -> dict[str, Any]:
        key = (delta.choice_index, delta.tool_index)
        if key in self._tool_calls_seen:
            return {"index": delta.tool_index, "function": {"arguments": delta.arguments}}
        self._tool_calls_seen.add(key)
        return {
            "index": delta.tool_index,
            "id": delta.id or new_tool_call_id(),
            "type": "function",
            "function": {"name": delta.name, "arguments": delta.arguments},
        }

    def _delta(
        self, index: int, delta: dict[str, Any], logprobs: dict[str, Any] | None
    ) -> list[dict[str, Any]]:
        chunks = self._announce(index)
        chunks.append(self._chunk([self._choice(index, delta, None, logprobs)]))
        return chunks

    def _announce(self, index: int) -> list[dict[str, Any]]:
        return [] if index in self._announced else [self._role_chunk(index)]

    def _role_chunk(self, index: int) -> dict[str, Any]:
        self._announced.add(index)
        return self._chunk([self._choice(index, {"role": "assistant", "content": ""}, None)])

    @staticmethod
    def _choice(
        index: int, delta: dict[str, Any], finish_reason: str | None, logprobs: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return self._envelope.chunk(choices)

    # ------------------------------------------------------------ result

    def add(self, call: int, event: worker_pb2.GenerateResponse) -> None:
        """Records one event for the non-streamed ``chat.completion`` (:meth:`result`)."""
        self.usage.on_event(call, event)
        kind = event.WhichOneof("event")
        if kind == "started":
            for i in range(max(1, event.started.n)):
                self._state(i)
        elif kind == "content":
            state = self._state(event.content.choice_index)
            state.content.append(event.content.text)
            state.logprobs.extend(logprob_entries(event.content.logprobs))
        elif kind == "reasoning":
            self._state(event.reasoning.choice_index).reasoning.append(event.reasoning.text)
        elif kind == "refusal":
            state = self._state(event.refusal.choice_index)
            state.refusal.append(event.refusal.text)
            state.refusal_logprobs.extend(logprob_entries(event.refusal.logprobs))
        elif kind == "tool_call":
            delta = event.tool_call
            calls = self._state(delta.choice_index).tool_calls
            if delta.tool_index not in calls:
                calls[delta.tool_index] = {
                    "id": delta.id or new_tool_call_id(),
                    "type": "function",
                    "function": {"name": delta.name, "arguments": ""},
                }
            calls[delta.tool_index]["function"]["arguments"] += delta.arguments
        elif kind == "finished":
            self._state(event.finished.choice_index).finish_reason = finish_reason_name(event.finished.reason)

    def _state(self, index: int) -> _ChoiceState:
        return self._choices.setdefault(index, _ChoiceState())

    def result(self) -> dict[str, Any]:
        """The ``chat.completion`` dict (choices ordered by index)."""
        choices = [self._render(i, s) for i, s in sorted(self._choices.items())]
        return self._body(
            "chat.completion", choices, system_fingerprint=self.system_fingerprint, service_tier=None
        )

    def _render(self, index: int, state: _ChoiceState) -> dict[str, Any]:
        text = "".join(state.content)
        message: dict[str, Any] = {
            "role": "assistant",
            # OpenAI sends null content for a pure tool-call or refusal answer.
            "content": text if text or not (state.tool_calls or state.refusal) else None,
            "refusal": "".join(state.refusal) or None,
        }
        if state.tool_calls:
            message["tool_calls"] = [state.tool_calls[k] for k in sorted(state.tool_calls)]
        if state.reasoning:
            message["reasoning_content"] = "".join(state.reasoning)
        logprobs = None
        if self.logprobs:
            logprobs = {"content": state.logprobs, "refusal": state.refusal_logprobs or None}
        return {
            "index": index,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": state.finish_reason or "stop",
        }
