"""What the Responses, Anthropic Messages and native request parsers share.

Design notes: docs/edge-internals.md.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Generic, Literal, TypeVar

from pydantic import BaseModel, StrictBool

from edge.errors import EdgeError, InvalidRequestError
from edge.requests.models import RequestModel
from edge.requests.validation import bad, invalid, validate_body
from edge.surfaces.shared.chat_request import (
    ChatCompletionRequest,
    FunctionDefinition,
    parse_chat_request,
    placed_param,
)

ModelT = TypeVar("ModelT", bound=BaseModel)
RequestT = TypeVar("RequestT", bound=RequestModel)


def rebase(error: EdgeError, prefix: str) -> InvalidRequestError:
    """``error`` (from validating a part of the body) with its ``param`` under ``prefix``."""
    inner = error.param
    param = prefix if not inner else f"{prefix}{inner}" if inner.startswith("[") else f"{prefix}.{inner}"
    message = error.message.replace(f"'{inner}'", f"'{param}'", 1) if inner else error.message
    return InvalidRequestError(message, param=param, code=error.code)


def validate_at(model: type[ModelT], value: Any, where: str) -> ModelT:
    """Validates one part of a body (an input item, a content block) found at ``where``;
    errors name the full path (``input[2].call_id``)."""
    if not isinstance(value, dict):
        raise InvalidRequestError(
            f"Invalid '{where}': must be a JSON object.", param=where, code="invalid_type"
        )
    try:
        return validate_body(model, value)
    except EdgeError as error:
        raise rebase(error, where) from None


# The key under which a surface's image part (:func:`image_part`) carries its place in the caller's body.
_PLACE = "\0place"


def image_part(url: str, detail: str | None, place: str) -> dict[str, Any]:
    """A chat ``image_url`` part for an image found at ``place`` in the caller's body
    (``input[2].content[1]``): the chat rules' errors about it name ``place``."""
    image_url = {"url": url} if detail is None else {"url": url, "detail": detail}
    return {"type": "image_url", "image_url": image_url, _PLACE: place}


def base64_url(media_type: str, data: str) -> str:
    """The data URL of base64 ``data`` declared as ``media_type``."""
    return f"data:{media_type};base64,{data}"


def _take_places(chat_body: dict[str, Any]) -> dict[str, str]:
    """The places of the body's :func:`image_part` parts by their chat path (taken out of the parts)."""
    places: dict[str, str] = {}
    for i, message in enumerate(chat_body.get("messages") or ()):
        content = message.get("content") if isinstance(message, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else ()):
            if isinstance(part, dict) and _PLACE in part:
                places[f"messages[{i}].content[{j}]"] = part.pop(_PLACE)
    return places


def to_chat_request(chat_body: dict[str, Any], renames: Mapping[str, str]) -> ChatCompletionRequest:
    """Parses the rewritten chat body with every chat rule and limit; a field the
    error names is given its surface's name (an image part's: its place in the caller's body;
    others by ``renames``: chat name → surface name, matched on the first path segment)."""
    places = _take_places(chat_body)
    try:
        chat = parse_chat_request(chat_body)
    except InvalidRequestError as error:
        param = error.param or ""
        placed = placed_param(param, places)
        if placed is not None:
            raise InvalidRequestError(
                error.message.replace(f"'{param}'", f"'{placed}'"), param=placed, code=error.code
            ) from None
        head = param.split(".")[0].split("[")[0]
        if head not in renames:
            raise
        surface = renames[head]
        # An index into the rewritten messages does not name the caller's item: name the list.
        renamed = surface if head == "messages" else surface + param[len(head) :]
        raise InvalidRequestError(
            error.message.replace(f"'{param}'", f"'{renamed}'"), param=renamed, code=error.code
        ) from None
    chat.keep_places(places)
    return chat


def compact_json(obj: Any) -> str:
    """JSON text without spaces (tool-call arguments, as the chat API carries them)."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def unsupported(param: str, message: str) -> InvalidRequestError:
    """A 400 ``unsupported_parameter`` naming ``param``."""
    return InvalidRequestError(message, param=param, code="unsupported_parameter")


def string_or_list(value: Any) -> Any:
    """A "before" validator for ``str | list`` fields: one clear error instead of
    pydantic's per-union-member errors (whose locations carry the member's name)."""
    if not isinstance(value, str | list):
        raise invalid("must be a string or an array")
    return value


def flat_tool_choice(value: Any) -> Any:
    """A "before" validator for the flat ``tool_choice`` of the Responses and native APIs: a mode
    string or ``{"type": "function", "name": ...}``."""
    if isinstance(value, str) and value not in ("none", "auto", "required"):
        raise invalid("must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}")
    if value is not None and not isinstance(value, str | dict):
        raise invalid("must be a string or an object")
    return value


class FunctionTool(RequestModel):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


def function_tools(raw_tools: list[Any] | None) -> list[FunctionTool]:
    """The flat ``tools`` of the Responses and native APIs: function tools only, each name
    checked here (as chat checks it) so that an error names ``tools[i]``."""
    tools = []
    for i, raw in enumerate(raw_tools or ()):
        where = f"tools[{i}]"
        kind = raw.get("type") if isinstance(raw, dict) else None
        if kind != "function":
            raise unsupported(
                f"{where}.type", f"Tool type {kind!r} is not supported; only 'function' tools are."
            )
        tool = validate_at(FunctionTool, raw, where)
        validate_at(FunctionDefinition, {"name": tool.name}, where)
        tools.append(tool)
    return tools


def add_chat_tools(
    chat_body: dict[str, Any], tools: list[FunctionTool], tool_choice: str | dict[str, Any] | None
) -> None:
    """Adds flat ``tools`` (from :func:`function_tools`) and ``tool_choice`` to ``chat_body`` in
    chat's shape."""
    if tools:
        dumped = [tool.model_dump(exclude={"type"}, exclude_none=True) for tool in tools]
        chat_body["tools"] = [{"type": "function", "function": tool} for tool in dumped]
    if tool_choice is not None:
        chat_body["tool_choice"] = chat_tool_choice(tool_choice)


def chat_tool_choice(choice: str | dict[str, Any]) -> Any:
    """A flat ``tool_choice`` (a mode, or ``{"type": "function", "name": ...}``) as chat's."""
    if isinstance(choice, str):
        return choice
    name = choice.get("name")
    if choice.get("type") != "function" or not isinstance(name, str) or not name:
        raise bad("tool_choice", "a named tool choice must be {'type': 'function', 'name': ...}")
    return {"type": "function", "function": {"name": name}}


class ParsedRequest(Generic[RequestT]):
    """A surface's validated request, the chat request it was rewritten into (which carries the
    surface's own ``stream``) and its flat function tools, if the surface has them."""

    def __init__(
        self, request: RequestT, chat: ChatCompletionRequest, tools: Sequence[FunctionTool] = ()
    ) -> None:
        self.request = request
        self.chat = chat
        self.tools = list(tools)

    @property
    def stream(self) -> bool:
        return self.chat.stream
