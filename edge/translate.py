"""Pure translation between the OpenAI chat wire shapes and the gRPC contract.

- :func:`to_generate_request`: a validated chat request → ``GenerateRequest``.
- :func:`sampling_params`: the sampling fields every request shares (also
  used by :mod:`edge.translate_completions`).
- :func:`call_metadata`: the gRPC call metadata (``x-request-id``).
- :class:`ChunkBuilder`: each ``GenerateResponse`` → zero or more
  ``chat.completion.chunk`` dicts (DESIGN.md section 3), then
  :meth:`ChunkBuilder.finish` for the usage chunk.
- :class:`CompletionAccumulator`: the same events → one ``chat.completion``.

No I/O here; everything is deterministic given its inputs (ids and
timestamps are passed in), so golden tests pin the exact dicts.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from edge.openai_types import (
    ChatCompletionRequest,
    ChatMessage,
    ResponseFormat,
    SamplingRequest,
    ToolChoice,
)
from edge.usage import StreamEnvelope, UsageTracker
from sluice.ids import new_tool_call_id
from sluice.v1 import worker_pb2

_UINT64 = 2**64
_FINISH_REASONS: dict[int, str] = {
    worker_pb2.STOP: "stop",
    worker_pb2.LENGTH: "length",
    worker_pb2.TOOL_CALLS: "tool_calls",
    worker_pb2.CONTENT_FILTER: "content_filter",
}
_TOOL_CHOICE_MODES = {
    "none": worker_pb2.ToolChoice.NONE,
    "auto": worker_pb2.ToolChoice.AUTO,
    "required": worker_pb2.ToolChoice.REQUIRED,
}


def new_completion_id() -> str:
    """A fresh ``chatcmpl-<32 hex>`` id."""
    return f"chatcmpl-{uuid.uuid4().hex}"


# ------------------------------------------------------------------ request


def to_generate_request(request: ChatCompletionRequest, request_id: str) -> worker_pb2.GenerateRequest:
    """Builds the worker request; every accepted field lands in the proto.

    Proto3 ``optional`` sampling fields are set only when the caller gave
    them, so the worker's defaults apply otherwise.
    """
    chat = worker_pb2.ChatInput(
        messages=[_message(m) for m in request.messages],
        tools=[
            worker_pb2.Tool(
                name=tool.function.name,
                description=tool.function.description or "",
                parameters_json=_compact(tool.function.parameters)
                if tool.function.parameters is not None
                else "",
                strict=bool(tool.function.strict),
            )
            for tool in request.tools or ()
        ],
        # OpenAI's default is true; the proto's bool defaults to false, so always set it.
        parallel_tool_calls=True if request.parallel_tool_calls is None else request.parallel_tool_calls,
    )
    if request.tool_choice is not None:
        chat.tool_choice.CopyFrom(_tool_choice(request.tool_choice))
    template_kwargs = dict(request.chat_template_kwargs or {})
    thinking = template_kwargs.pop("enable_thinking", None)
    if request.reasoning_effort == "none":
        thinking = False
    if isinstance(thinking, bool):
        chat.enable_thinking = thinking
    if template_kwargs:
        chat.chat_template_kwargs_json = _compact(template_kwargs)
    sampling = sampling_params(request, max_tokens=request.completion_token_limit)
    if request.logprobs:
        sampling.logprobs = request.top_logprobs or 0
    proto = worker_pb2.GenerateRequest(
        request_id=request_id,
        model=request.model,
        chat=chat,
        sampling=sampling,
        # Token ids are only needed to count completion tokens for continuous usage.
        return_token_ids=request.stream and request.continuous_usage,
        user=request.user or "",
        metadata=request.metadata or {},
    )
    if request.response_format is not None:
        proto.response_format.CopyFrom(_response_format(request.response_format))
    return proto


def call_metadata(request: SamplingRequest, request_id: str) -> tuple[tuple[str, str | bytes], ...]:
    """gRPC metadata for the call: the request id, so worker logs carry it too."""
    return (("x-request-id", request_id),)


def _compact(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def _message(message: ChatMessage) -> worker_pb2.ChatMessage:
    proto = worker_pb2.ChatMessage(
        role=message.role,
        tool_calls=[
            worker_pb2.ToolCall(id=call.id, name=call.function.name, arguments=call.function.arguments)
            for call in message.tool_calls or ()
        ],
        tool_call_id=message.tool_call_id or "",
        name=message.name or "",
    )
    if message.content is not None:
        proto.content = message.content
    if message.reasoning_content is not None:
        proto.reasoning_content = message.reasoning_content
    return proto


def _tool_choice(choice: ToolChoice) -> worker_pb2.ToolChoice:
    if choice.mode == "function":
        return worker_pb2.ToolChoice(function_name=choice.function_name or "")
    return worker_pb2.ToolChoice(mode=_TOOL_CHOICE_MODES[choice.mode])


def _response_format(fmt: ResponseFormat) -> worker_pb2.ResponseFormat:
    if fmt.type == "json_object":
        return worker_pb2.ResponseFormat(json_object=True)
    if fmt.type == "json_schema" and fmt.json_schema is not None:
        schema = fmt.json_schema
        return worker_pb2.ResponseFormat(
            json_schema=worker_pb2.JsonSchema(
                name=schema.name,
                schema_json=_compact(schema.schema_) if schema.schema_ is not None else "",
                strict=bool(schema.strict),
            )
        )
    return worker_pb2.ResponseFormat(text=True)


def sampling_params(request: SamplingRequest, *, max_tokens: int | None) -> worker_pb2.SamplingParams:
    """The shared sampling fields; unset ones stay unset (the worker's defaults apply).

    ``max_tokens`` is passed in because each API has its own rule for it;
    ``logprobs`` is left to the caller for the same reason.
    """
    sampling = worker_pb2.SamplingParams(stop=request.stop or [])
    if request.temperature is not None:
        sampling.temperature = request.temperature
    if request.top_p is not None:
        sampling.top_p = request.top_p
    if request.n is not None:
        sampling.n = request.n
    if request.seed is not None:
        # OpenAI seeds are int64; the proto's is uint64: keep the bits (two's complement).
        sampling.seed = request.seed % _UINT64
    if request.presence_penalty is not None:
        sampling.presence_penalty = request.presence_penalty
    if request.frequency_penalty is not None:
        sampling.frequency_penalty = request.frequency_penalty
    if max_tokens is not None:
        sampling.max_tokens = max_tokens
    if request.ignore_eos is not None:
        sampling.ignore_eos = request.ignore_eos
    if request.min_tokens is not None:
        sampling.min_tokens = request.min_tokens
    for token, bias in (request.logit_bias or {}).items():
        sampling.logit_bias[int(token)] = bias
    return sampling


# ----------------------------------------------------------------- responses


def finish_reason_name(reason: int) -> str:
    """The OpenAI ``finish_reason`` for a proto ``FinishReason`` (unspecified → "stop")."""
    return _FINISH_REASONS.get(reason, "stop")


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
class ChunkBuilder:
    """Turns the events of one call into ``chat.completion.chunk`` dicts.

    Construct once per response with the fixed ``id``/``created``/``model``;
    feed every event in order to :meth:`on_event`, then call :meth:`finish`
    once the call ended OK. ``started`` yields one role chunk per choice
    (indexes increasing); a delta for a choice not yet announced yields that
    choice's role chunk first, so the role always comes first whatever the
    worker sends. Each ``finished`` yields that choice's ``delta: {}`` chunk
    with its ``finish_reason``.

    Usage: with ``include_usage``, :meth:`finish` yields one more chunk with
    ``choices: []`` and the total ``usage``, and every other chunk carries
    ``"usage": null``; with ``continuous_usage``, every chunk carries the usage
    so far instead (see :class:`~edge.usage.UsageTracker`); with neither, no
    chunk has a ``usage`` key.

    The fields every chunk shares (``id``, ``created``, ``model``, usage mode,
    ``system_fingerprint``) are read once, at construction.

    :meth:`on_event` runs once per streamed token, so its content path is
    kept short: one oneof lookup (shared with the usage tracker) and one
    envelope copy per chunk.
    """

    id: str
    created: int
    model: str
    include_usage: bool = False
    continuous_usage: bool = False
    logprobs: bool = False
    system_fingerprint: str | None = None
    usage: UsageTracker = field(default_factory=UsageTracker)
    _announced: set[int] = field(default_factory=set)
    _tool_calls_seen: set[tuple[int, int]] = field(default_factory=set)
    _envelope: StreamEnvelope = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._envelope = StreamEnvelope(
            object_name="chat.completion.chunk",
            completion_id=self.id,
            created=self.created,
            model=self.model,
            usage=self.usage,
            include_usage=self.include_usage,
            continuous_usage=self.continuous_usage,
            system_fingerprint=self.system_fingerprint,
            service_tier=None,
        )

    def on_event(self, event: worker_pb2.GenerateResponse) -> list[dict[str, Any]]:
        """Chunks for one event, in wire order (possibly none)."""
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

    def finish(self) -> list[dict[str, Any]]:
        """The chunks after the last event: the usage chunk when ``include_usage``."""
        if not self.include_usage:
            return []
        chunk = self._chunk([])
        chunk["usage"] = self.usage.final()
        return [chunk]

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
class CompletionAccumulator:
    """Builds the non-streaming ``chat.completion`` from the same events.

    Feed every event to :meth:`add`, then call :meth:`result` once the call
    ended OK. ``usage`` is always present (:meth:`~edge.usage.UsageTracker.final`).
    """

    id: str
    created: int
    model: str
    logprobs: bool = False
    system_fingerprint: str | None = None
    usage: UsageTracker = field(default_factory=UsageTracker)
    _choices: dict[int, _ChoiceState] = field(default_factory=dict)

    def add(self, event: worker_pb2.GenerateResponse) -> None:
        self.usage.on_event(0, event)
        kind = event.WhichOneof("event")
        if kind == "started":
            for i in range(max(1, event.started.n)):
                self._choice(i)
        elif kind == "content":
            state = self._choice(event.content.choice_index)
            state.content.append(event.content.text)
            state.logprobs.extend(logprob_entries(event.content.logprobs))
        elif kind == "reasoning":
            self._choice(event.reasoning.choice_index).reasoning.append(event.reasoning.text)
        elif kind == "refusal":
            state = self._choice(event.refusal.choice_index)
            state.refusal.append(event.refusal.text)
            state.refusal_logprobs.extend(logprob_entries(event.refusal.logprobs))
        elif kind == "tool_call":
            delta = event.tool_call
            calls = self._choice(delta.choice_index).tool_calls
            if delta.tool_index not in calls:
                calls[delta.tool_index] = {
                    "id": delta.id or new_tool_call_id(),
                    "type": "function",
                    "function": {"name": delta.name, "arguments": ""},
                }
            calls[delta.tool_index]["function"]["arguments"] += delta.arguments
        elif kind == "finished":
            self._choice(event.finished.choice_index).finish_reason = finish_reason_name(
                event.finished.reason
            )

    def _choice(self, index: int) -> _ChoiceState:
        return self._choices.setdefault(index, _ChoiceState())

    def result(self) -> dict[str, Any]:
        """The ``chat.completion`` dict (choices ordered by index)."""
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.system_fingerprint,
            "service_tier": None,
            "choices": [self._render(i, s) for i, s in sorted(self._choices.items())],
            "usage": self.usage.final(),
        }

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
