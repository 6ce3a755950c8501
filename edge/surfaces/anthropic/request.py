"""The Anthropic Messages request (``POST /v1/messages``), validated and rewritten as chat.

Design notes: docs/edge-internals.md.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

from pydantic import Field, StrictBool, field_validator

from edge.errors import InvalidRequestError
from edge.requests.models import RequestModel
from edge.requests.validation import in_range, invalid, missing, validate_body
from edge.surfaces.shared.chat_request import FunctionDefinition
from edge.surfaces.shared.rewrite import (
    ParsedRequest,
    base64_url,
    compact_json,
    image_part,
    string_or_list,
    to_chat_request,
    unsupported,
    validate_at,
)
from edge.surfaces.shared.sampling import SamplingExtensions
from sluice.limits import TOP_P

MAX_TOP_K = 2**31 - 1
# Prompt-caching hints: this server caches prompt prefixes by itself.
_CACHE_CONTROL = frozenset({"cache_control"})


class TextBlock(RequestModel):
    ignored_fields = _CACHE_CONTROL
    type: Literal["text"]
    text: str


class ToolUseBlock(RequestModel):
    ignored_fields = _CACHE_CONTROL
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]


class ToolResultBlock(RequestModel):
    ignored_fields = _CACHE_CONTROL
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[Any] = ""
    is_error: StrictBool | None = None

    _content = field_validator("content", mode="before")(string_or_list)


class ThinkingBlock(RequestModel):
    ignored_fields = _CACHE_CONTROL
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class ImageSource(RequestModel):
    """An image block's source: ``base64`` (``media_type``, ``data``) or ``url``."""

    type: Literal["base64", "url"]
    media_type: str | None = None
    data: str | None = None
    url: str | None = None


class ImageBlock(RequestModel):
    ignored_fields = _CACHE_CONTROL
    type: Literal["image"]
    source: ImageSource


class InputMessage(RequestModel):
    role: Literal["user", "assistant"]
    content: str | list[Any]

    _content = field_validator("content", mode="before")(string_or_list)


class CustomTool(RequestModel):
    ignored_fields = _CACHE_CONTROL | {"type"}  # the type is checked first (only custom tools)
    name: str
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(RequestModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: StrictBool | None = None


class Thinking(RequestModel):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(default=None, ge=0)


class Metadata(RequestModel):
    user_id: str | None = None


class MessagesRequest(SamplingExtensions):
    """A ``POST /v1/messages`` body, shape-checked (docs/edge-internals.md, "Anthropic request")."""

    ignored_fields = frozenset({"service_tier"})

    model: str
    max_tokens: int = Field(ge=1)
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0, le=1)  # Anthropic's range, inside the contract's
    top_p: float | None = in_range(TOP_P)
    top_k: int | None = Field(default=None, ge=1, le=MAX_TOP_K)  # Anthropic's bound (not vLLM's -1/0)
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    metadata: Metadata | None = None
    stream: StrictBool = False

    @field_validator("system", mode="before")
    @classmethod
    def _system_shape(cls, value: Any) -> Any:
        if value is not None and not isinstance(value, str | list):
            raise invalid("must be a string or an array of text blocks")
        return value


class CountTokensRequest(MessagesRequest):
    """A ``POST /v1/messages/count_tokens`` body: a Messages body whose ``max_tokens`` may be left out
    (nothing is generated)."""

    max_tokens: int = Field(default=1, ge=1)


class ParsedMessagesRequest(ParsedRequest[MessagesRequest]):
    """The validated request and its chat equivalent."""


def parse_messages_request(
    body: Any, model: type[MessagesRequest] = MessagesRequest
) -> ParsedMessagesRequest:
    """Validates a decoded ``/v1/messages`` body (``model``: :class:`CountTokensRequest` for
    ``count_tokens``); raises a 400 naming the field."""
    request = validate_body(model, body)
    chat_body: dict[str, Any] = {
        "model": request.model,
        "messages": _messages(request),
        "max_completion_tokens": request.max_tokens,
        "stream": request.stream,
        **request.given_extensions(),
    }
    if request.stop_sequences:
        chat_body["stop"] = request.stop_sequences
    for name in ("temperature", "top_p"):
        value = getattr(request, name)
        if value is not None:
            chat_body[name] = value
    tools = [_tool(tool, f"tools[{i}]") for i, tool in enumerate(request.tools or ())]
    if tools:
        chat_body["tools"] = tools
    choice = request.tool_choice
    if choice is not None:
        if choice.type == "tool" and not choice.name:
            raise unsupported("tool_choice.name", "tool_choice of type 'tool' needs the tool's 'name'.")
        chat_body["tool_choice"] = (
            {"type": "function", "function": {"name": choice.name}}
            if choice.type == "tool"
            else {"auto": "auto", "any": "required", "none": "none"}[choice.type]
        )
        if choice.disable_parallel_tool_use:
            chat_body["parallel_tool_calls"] = False
    if request.thinking is not None and request.thinking.type == "disabled":
        chat_body["reasoning_effort"] = "none"
    elif request.thinking is not None and request.thinking.budget_tokens is not None:
        chat_body["thinking_token_budget"] = request.thinking.budget_tokens
    if request.metadata is not None and request.metadata.user_id:
        chat_body["user"] = request.metadata.user_id
    chat = to_chat_request(
        chat_body,
        {
            "messages": "messages",
            "max_completion_tokens": "max_tokens",
            "stop": "stop_sequences",
            "thinking_token_budget": "thinking.budget_tokens",
        },
    )
    return ParsedMessagesRequest(request, chat)


def _tool(raw: dict[str, Any], where: str) -> dict[str, Any]:
    if raw.get("type") not in (None, "custom"):
        raise unsupported(
            f"{where}.type", f"Tool type {raw.get('type')!r} is not supported; only custom tools are."
        )
    tool = validate_at(CustomTool, raw, where)
    validate_at(FunctionDefinition, {"name": tool.name}, where)
    function: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema}
    if tool.description is not None:
        function["description"] = tool.description
    return {"type": "function", "function": function}


def _messages(request: MessagesRequest) -> list[dict[str, Any]]:
    """The conversation as chat messages: the system prompt, then each message's blocks.

    A user message's ``tool_result`` blocks become ``tool`` messages (in block
    order, before its text); an assistant message's ``tool_use`` blocks become
    its ``tool_calls`` and its ``thinking`` its ``reasoning_content``.
    """
    messages: list[dict[str, Any]] = []
    system = request.system
    if isinstance(system, str):
        messages.append({"role": "system", "content": system})
    elif system:
        messages.append({"role": "system", "content": "\n".join(block.text for block in system)})
    for i, message in enumerate(request.messages):
        where = f"messages[{i}].content"
        if isinstance(message.content, str):
            messages.append({"role": message.role, "content": message.content})
            continue
        if message.role == "user":
            messages += _user_blocks(message.content, where)
        else:
            messages.append(_assistant_blocks(message.content, where))
    return messages


def _block_type(block: Any, where: str) -> str:
    if not isinstance(block, dict):
        raise InvalidRequestError(
            f"Invalid '{where}': each content block must be an object.", param=where, code="invalid_type"
        )
    return str(block.get("type"))


def _typed_blocks(blocks: list[dict[str, Any]], where: str) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """Each content block with its place (``messages[0].content[1]``) and its checked type."""
    for j, block in enumerate(blocks):
        at = f"{where}[{j}]"
        yield at, _block_type(block, at), block


def _text(block: dict[str, Any], at: str) -> str:
    return validate_at(TextBlock, block, at).text


def _unsupported_block(at: str, kind: str, place: str) -> InvalidRequestError:
    return unsupported(f"{at}.type", f"Content block type {kind!r} is not supported in {place}.")


def _user_blocks(blocks: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    """The tool messages of the ``tool_result`` blocks, then the user message: its text blocks
    joined with newlines, or, with an image among them, its text and image blocks as chat parts."""
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for at, kind, block in _typed_blocks(blocks, where):
        if kind == "text":
            parts.append({"type": "text", "text": _text(block, at)})
        elif kind == "image":
            parts.append(_image(block, at))
        elif kind == "tool_result":
            result = validate_at(ToolResultBlock, block, at)
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": result.tool_use_id,
                    "content": _result_text(result, f"{at}.content"),
                }
            )
        else:
            raise _unsupported_block(at, kind, "a user message")
    if any(part["type"] == "image_url" for part in parts):
        out.append({"role": "user", "content": parts})
    elif parts or not out:
        out.append({"role": "user", "content": "\n".join(part["text"] for part in parts)})
    return out


def _image(block: dict[str, Any], at: str) -> dict[str, Any]:
    """An ``image`` block as a chat image part (whose bytes the chat rules check, naming ``at``)."""
    kind = block["source"].get("type") if isinstance(block.get("source"), dict) else None
    if kind is not None and kind not in ("base64", "url"):
        raise unsupported(
            f"{at}.source.type",
            f"Invalid '{at}.source.type': image source type {kind!r} is not "
            "supported; use 'base64' or 'url'.",
        )
    source = validate_at(ImageBlock, block, at).source
    if source.type == "url":
        if not source.url:
            raise missing(f"{at}.source.url", "a url image source needs its url")
        return image_part(source.url, None, at)
    if not source.media_type:
        raise missing(f"{at}.source.media_type", "a base64 image source needs its media_type")
    if source.data is None:
        raise missing(f"{at}.source.data", "a base64 image source needs its data")
    return image_part(base64_url(source.media_type, source.data), None, at)


def _result_text(result: ToolResultBlock, where: str) -> str:
    if isinstance(result.content, str):
        text = result.content
    else:
        parts = []
        for k, block in enumerate(result.content):
            at = f"{where}[{k}]"
            if _block_type(block, at) != "text":
                raise unsupported(f"{at}.type", "Only text blocks are supported in a tool_result.")
            parts.append(_text(block, at))
        text = "\n".join(parts)
    return f"Error: {text}" if result.is_error else text


def _assistant_blocks(blocks: list[dict[str, Any]], where: str) -> dict[str, Any]:
    texts: list[str] = []
    reasoning: list[str] = []
    calls: list[dict[str, Any]] = []
    for at, kind, block in _typed_blocks(blocks, where):
        if kind == "text":
            texts.append(_text(block, at))
        elif kind == "tool_use":
            use = validate_at(ToolUseBlock, block, at)
            calls.append(
                {
                    "id": use.id,
                    "type": "function",
                    "function": {"name": use.name, "arguments": compact_json(use.input)},
                }
            )
        elif kind == "thinking":
            reasoning.append(validate_at(ThinkingBlock, block, at).thinking)
        elif kind == "redacted_thinking":
            continue
        else:
            raise _unsupported_block(at, kind, "an assistant message")
    message: dict[str, Any] = {
        "role": "assistant",
        "content": "\n".join(texts) if texts or not calls else None,
    }
    if calls:
        message["tool_calls"] = calls
    if reasoning:
        message["reasoning_content"] = "\n".join(reasoning)
    return message
