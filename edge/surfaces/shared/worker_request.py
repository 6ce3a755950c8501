"""A validated chat request (or any surface's, rewritten as one) → the worker's ``GenerateRequest``.

Proto3 ``optional`` sampling fields are set only when the caller gave them, so the
worker's defaults apply otherwise.
"""

from __future__ import annotations

import json
from typing import Any

from edge.surfaces.shared.chat_request import (
    ChatCompletionRequest,
    ChatMessage,
    ImageUrlPart,
    ResponseFormat,
    TextPart,
    ToolChoice,
)
from edge.surfaces.shared.sampling import SamplingExtensions, SamplingRequest
from sluice.v1 import worker_pb2

_UINT64 = 2**64
_TOOL_CHOICE_MODES = {
    "none": worker_pb2.ToolChoice.NONE,
    "auto": worker_pb2.ToolChoice.AUTO,
    "required": worker_pb2.ToolChoice.REQUIRED,
}


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
    elif request.reasoning_effort is not None:
        chat.reasoning_effort = request.reasoning_effort
    if isinstance(thinking, bool):
        chat.enable_thinking = thinking
    if request.thinking_token_budget is not None:
        chat.thinking_token_budget = request.thinking_token_budget
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
        priority=request.priority or 0,
    )
    structured = request.structured()
    if structured is not None:
        proto.response_format.CopyFrom(structured.proto)
    elif request.response_format is not None:
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
    if isinstance(message.content, list):
        proto.parts.extend(_part(part) for part in message.content)
    elif message.content is not None:
        proto.content = message.content
    if message.reasoning_content is not None:
        proto.reasoning_content = message.reasoning_content
    return proto


def _part(part: TextPart | ImageUrlPart) -> worker_pb2.ContentPart:
    """One part of a message with images: text, or an image's bytes (resolved before the call)."""
    if isinstance(part, TextPart):
        return worker_pb2.ContentPart(text=part.text)
    image = part.image
    if image is None:  # an http(s) URL not fetched: a bug in the route (edge.surfaces.images)
        raise RuntimeError("an image URL reached the worker request unfetched")
    return worker_pb2.ContentPart(
        image=worker_pb2.ImageInput(
            data=image.data, mime_type=image.mime_type, detail=part.image_url.detail or ""
        )
    )


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
    for token, bias in (request.logit_bias or {}).items():
        sampling.logit_bias[int(token)] = bias
    apply_extensions(request, sampling)
    return sampling


def apply_extensions(request: SamplingExtensions, sampling: worker_pb2.SamplingParams) -> None:
    """Sets the vLLM extensions the caller gave on ``sampling`` (unset ones keep the worker's defaults)."""
    for name in (
        "top_k",
        "min_p",
        "repetition_penalty",
        "ignore_eos",
        "min_tokens",
        "skip_special_tokens",
        "speculative",
    ):
        value = getattr(request, name)
        if value is not None:
            setattr(sampling, name, value)
    if request.truncate_prompt_tokens is not None:
        sampling.truncate_prompt_tokens = request.truncate_prompt_tokens
    sampling.include_stop_str_in_output = bool(request.include_stop_str_in_output)
    sampling.stop_token_ids.extend(request.stop_token_ids or ())
    sampling.bad_words.extend(request.bad_words or ())
    sampling.allowed_token_ids.extend(request.allowed_token_ids or ())
