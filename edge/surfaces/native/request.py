"""The native chat request (``POST /api/v1/chat``), validated and rewritten as chat.

Design notes: docs/edge-internals.md.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, StrictBool, field_validator

from edge.requests.models import RequestModel
from edge.requests.validation import bad, in_range, validate_body
from edge.surfaces.shared.rewrite import (
    ParsedRequest,
    add_chat_tools,
    flat_tool_choice,
    function_tools,
    image_part,
    string_or_list,
    to_chat_request,
    validate_at,
)
from edge.surfaces.shared.sampling import SamplingExtensions
from sluice.limits import REPETITION_PENALTY, TEMPERATURE, TOP_P

_SEED_MAX = 2**64 - 1


class NativeMessage(RequestModel):
    role: Literal["system", "user", "assistant"]
    # A string, or chat's parts: ``text`` and ``image_url`` (a data URL, or an http(s) URL).
    content: str | list[Any]

    _content = field_validator("content", mode="before")(string_or_list)


def _content(content: str | list[Any], where: str) -> str | list[Any]:
    """The content as chat takes it, each image part tagged with its place (``input[i].content[j]``)."""
    if isinstance(content, str):
        return content
    return [_tagged(part, f"{where}[{j}]") for j, part in enumerate(content)]


def _tagged(part: Any, at: str) -> Any:
    if not isinstance(part, dict) or part.get("type") != "image_url":
        return part
    image_url = part.get("image_url")
    if isinstance(image_url, str):
        return image_part(image_url, None, at)
    if isinstance(image_url, dict) and isinstance(image_url.get("url"), str):
        return image_part(image_url["url"], image_url.get("detail"), at)
    return part


class NativeChatRequest(SamplingExtensions):
    """A ``POST /api/v1/chat`` body, shape-checked (docs/edge-internals.md, "Native request")."""

    model: str
    input: str | list[Any]
    system_prompt: str | None = None
    temperature: float | None = in_range(TEMPERATURE)
    top_p: float | None = in_range(TOP_P)
    # vLLM's repetition_penalty under the native name (either may be given, not both).
    repeat_penalty: float | None = in_range(REPETITION_PENALTY)
    seed: int | None = Field(default=None, ge=0, le=_SEED_MAX)
    stop: list[str] | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    reasoning: Literal["on", "off", "low", "medium", "high"] | None = None
    stream: StrictBool = False

    _input = field_validator("input", mode="before")(string_or_list)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    _tool_choice = field_validator("tool_choice", mode="before")(flat_tool_choice)


class ParsedNativeRequest(ParsedRequest[NativeChatRequest]):
    """The validated request, its chat equivalent, and the offered tools (for ``tool_call.failure``)."""


def parse_native_request(body: Any) -> ParsedNativeRequest:
    """Validates a decoded ``/api/v1/chat`` body; raises a 400 naming the field."""
    request = validate_body(NativeChatRequest, body)
    messages: list[dict[str, Any]] = []
    if request.system_prompt is not None:
        messages.append({"role": "system", "content": request.system_prompt})
    if isinstance(request.input, str):
        messages.append({"role": "user", "content": request.input})
    else:
        if not request.input:
            raise bad("input", "must hold at least one message")
        for i, item in enumerate(request.input):
            message = validate_at(NativeMessage, item, f"input[{i}]")
            messages.append(
                {"role": message.role, "content": _content(message.content, f"input[{i}].content")}
            )
    tools = function_tools(request.tools)
    chat_body: dict[str, Any] = {
        "model": request.model,
        "messages": messages,
        "stream": request.stream,
        **request.given_extensions(),
    }
    if request.repeat_penalty is not None:
        if request.repetition_penalty is not None:
            raise bad("repeat_penalty", "give repeat_penalty or repetition_penalty, not both")
        chat_body["repetition_penalty"] = request.repeat_penalty
    for name in ("temperature", "top_p", "seed", "stop"):
        value = getattr(request, name)
        if value is not None:
            chat_body[name] = value
    if request.max_output_tokens is not None:
        chat_body["max_completion_tokens"] = request.max_output_tokens
    add_chat_tools(chat_body, tools, request.tool_choice)
    if request.reasoning is not None:
        chat_body["chat_template_kwargs"] = {"enable_thinking": request.reasoning != "off"}
    if request.reasoning in ("low", "medium", "high"):  # the family's own effort switch, else a budget
        chat_body["reasoning_effort"] = request.reasoning
    chat = to_chat_request(
        chat_body, {"messages": "input", "max_completion_tokens": "max_output_tokens", "tools": "tools"}
    )
    return ParsedNativeRequest(request, chat, tools)
