"""The OpenAI Responses API request (``POST /v1/responses``), validated and rewritten as chat.

Design notes: docs/edge-internals.md.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, StrictBool, field_validator

from edge.errors import InvalidRequestError
from edge.requests.models import RequestModel
from edge.requests.validation import bad, in_range, validate_body
from edge.surfaces.shared.chat_request import JsonSchemaFormat
from edge.surfaces.shared.rewrite import (
    ParsedRequest,
    add_chat_tools,
    flat_tool_choice,
    function_tools,
    image_part,
    string_or_list,
    to_chat_request,
    unsupported,
    validate_at,
)
from edge.surfaces.shared.sampling import SamplingExtensions
from sluice.limits import TEMPERATURE, TOP_P


class InputText(RequestModel):
    """A text part of an input message (``input_text``, or ``output_text`` of an earlier answer)."""

    type: Literal["input_text", "output_text"]
    text: str

    ignored_fields = frozenset({"annotations", "logprobs"})  # an earlier answer's, sent back


class InputImage(RequestModel):
    """An image part of an input message: ``image_url`` a data URL or an http(s) URL (``file_id``:
    refused, this server stores no files)."""

    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None
    detail: Literal["auto", "low", "high"] | None = None


class InputMessage(RequestModel):
    ignored_fields = frozenset({"id", "status"})  # an earlier answer's item, sent back

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[Any]

    _content = field_validator("content", mode="before")(string_or_list)


class FunctionCallItem(RequestModel):
    """A call the model made in an earlier turn, sent back by the caller."""

    ignored_fields = frozenset({"id", "status"})

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str


class FunctionCallOutputItem(RequestModel):
    """The caller's result of a function call."""

    ignored_fields = frozenset({"id", "status"})

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[Any]

    _output = field_validator("output", mode="before")(string_or_list)


class TextFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None
    description: str | None = None


class TextOptions(RequestModel):
    format: TextFormat | None = None


class ReasoningOptions(RequestModel):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: str | None = None


class ResponsesRequest(SamplingExtensions):
    """A ``POST /v1/responses`` body, shape-checked (docs/edge-internals.md, "Responses request")."""

    ignored_fields = frozenset({"service_tier", "prompt_cache_key", "safety_identifier"})

    model: str
    input: str | list[Any]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    text: TextOptions | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = in_range(TEMPERATURE)
    top_p: float | None = in_range(TOP_P)
    reasoning: ReasoningOptions | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    stream: StrictBool = False
    store: StrictBool | None = None
    background: StrictBool | None = None
    previous_response_id: str | None = None
    conversation: Any = None

    _input = field_validator("input", mode="before")(string_or_list)

    _tool_choice = field_validator("tool_choice", mode="before")(flat_tool_choice)


class ParsedResponsesRequest(ParsedRequest[ResponsesRequest]):
    """The validated request: its own fields (echoed in the answer) and the equivalent chat request."""

    @property
    def stored(self) -> bool:
        """Whether the response is stored (``store`` defaults to true, as OpenAI's)."""
        return self.request.store is not False

    def echo(self) -> dict[str, Any]:
        """The request fields a Response object repeats (``tools``, ``temperature``, ...)."""
        r = self.request
        fmt = r.text.format if r.text is not None and r.text.format is not None else None
        text_format: dict[str, Any] = {"type": "text"}
        if fmt is not None:
            text_format = fmt.model_dump(by_alias=True, exclude_none=True)
        choice: Any = r.tool_choice if r.tool_choice is not None else "auto"
        return {
            "background": bool(r.background),
            "previous_response_id": r.previous_response_id,
            "conversation": None if r.conversation is None else {"id": conversation_id(r)},
            "store": self.stored,
            "instructions": r.instructions,
            "max_output_tokens": r.max_output_tokens,
            "parallel_tool_calls": True if r.parallel_tool_calls is None else r.parallel_tool_calls,
            "reasoning": {"effort": r.reasoning.effort if r.reasoning else None, "summary": None},
            "temperature": r.temperature,
            "text": {"format": text_format},
            "tool_choice": choice,
            "tools": [
                tool.model_dump(exclude_none=True) | {"strict": bool(tool.strict)} for tool in self.tools
            ],
            "top_p": r.top_p,
            "user": r.user,
            "metadata": r.metadata or {},
        }


def parse_responses_request(body: Any) -> ParsedResponsesRequest:
    """Validates a decoded ``/v1/responses`` body; raises :class:`InvalidRequestError` naming the field."""
    return build_responses_request(validate_responses_request(body), [])


def validate_responses_request(body: Any) -> ResponsesRequest:
    """The body's shape checked, and the state options it combines checked together."""
    request = validate_body(ResponsesRequest, body)
    if request.conversation is not None:
        conversation_id(request)  # its shape
        if request.previous_response_id is not None:
            raise bad("conversation", "cannot be used with 'previous_response_id'")
    if request.background and request.store is False:
        raise bad("background", "needs 'store' (a background response is read back by polling)")
    return request


def conversation_id(request: ResponsesRequest) -> str | None:
    """The id ``conversation`` names (a string, or ``{"id": ...}``); a 400 for another shape."""
    value = request.conversation
    if isinstance(value, dict):
        value = value.get("id")
    if request.conversation is not None and not isinstance(value, str):
        raise bad("conversation", "must be a conversation id or an object with its 'id'")
    return value


def check_items(items: list[Any], name: str) -> None:
    """Raises the 400 ``input`` would get for ``items`` that are not input items, naming
    ``name[i]``."""
    _messages(ResponsesRequest(model="", input=items), [], name)


def input_items(request: ResponsesRequest) -> list[dict[str, Any]]:
    """This turn's input as items (a string input is one user message)."""
    if isinstance(request.input, str):
        return [{"type": "message", "role": "user", "content": request.input}]
    return list(request.input)


def build_responses_request(request: ResponsesRequest, history: list[Any]) -> ParsedResponsesRequest:
    """The chat request for ``request`` after the conversation items of ``history`` (a stored
    response's, for ``previous_response_id``): its instructions, the history, then its input."""
    tools = function_tools(request.tools)
    chat_body: dict[str, Any] = {
        "model": request.model,
        "messages": _messages(request, history),
        "stream": request.stream,
        **request.given_extensions(),
    }
    add_chat_tools(chat_body, tools, request.tool_choice)
    for name in ("parallel_tool_calls", "temperature", "top_p", "metadata", "user"):
        value = getattr(request, name)
        if value is not None:
            chat_body[name] = value
    if request.max_output_tokens is not None:
        chat_body["max_completion_tokens"] = request.max_output_tokens
    if request.reasoning is not None and request.reasoning.effort is not None:
        effort = request.reasoning.effort
        chat_body["reasoning_effort"] = "high" if effort == "xhigh" else effort
    fmt = request.text.format if request.text is not None else None
    if fmt is not None:
        chat_body["response_format"] = _response_format(fmt)
    chat = to_chat_request(
        chat_body,
        {
            "messages": "input",
            "max_completion_tokens": "max_output_tokens",
            "response_format": "text.format",
        },
    )
    return ParsedResponsesRequest(request, chat, tools)


def _response_format(fmt: TextFormat) -> dict[str, Any]:
    if fmt.type != "json_schema":
        return {"type": fmt.type}
    if fmt.schema_ is None:
        raise InvalidRequestError(
            "Missing required parameter: 'text.format.schema'.",
            param="text.format.schema",
            code="missing_required_parameter",
        )
    schema = JsonSchemaFormat.model_validate(
        {"name": fmt.name or "response", "schema": fmt.schema_, "strict": fmt.strict}
    )
    return {"type": "json_schema", "json_schema": schema.model_dump(by_alias=True, exclude_none=True)}


def _messages(request: ResponsesRequest, history: list[Any], label: str = "input") -> list[dict[str, Any]]:
    """The conversation as chat messages: instructions first, then the history's items and the
    input items in order; consecutive ``function_call`` items become one assistant message with
    several calls. An error names the input item as ``label[i]``."""
    messages: list[dict[str, Any]] = []
    if request.instructions is not None:
        messages.append({"role": "system", "content": request.instructions})
    if isinstance(request.input, list) and not request.input:
        raise bad(label, "must hold at least one item")
    items = [*history, *input_items(request)]
    for i, item in enumerate(items):
        # A history item's place is not the caller's: name the input item it precedes.
        where = f"{label}[{max(i - len(history), 0)}]"
        if not isinstance(item, dict):
            raise InvalidRequestError(
                f"Invalid '{where}': each input item must be an object.", param=where, code="invalid_type"
            )
        kind = item.get("type", "message")
        if kind == "message":
            message = validate_at(InputMessage, item, where)
            messages.append({"role": message.role, "content": _content(message.content, f"{where}.content")})
        elif kind == "function_call":
            call = validate_at(FunctionCallItem, item, where)
            tool_call = {
                "id": call.call_id,
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(tool_call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [tool_call]})
        elif kind == "function_call_output":
            output = validate_at(FunctionCallOutputItem, item, where)
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": output.call_id,
                    "content": _text(output.output, f"{where}.output"),
                }
            )
        elif kind == "reasoning":
            continue  # the model's earlier reasoning is not sent back to it
        else:
            raise unsupported(f"{where}.type", f"Input item type {kind!r} is not supported.")
    return messages


def _content(content: str | list[Any], where: str) -> str | list[dict[str, Any]]:
    """A string, or text parts joined with a newline (as chat joins its parts); with an
    ``input_image`` among them, the parts in order as chat parts."""
    if isinstance(content, str):
        return content
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image":
            parts.append(_image(validate_at(InputImage, part, at), at))
        elif kind in ("input_text", "output_text"):
            parts.append({"type": "text", "text": validate_at(InputText, part, at).text})
        else:
            raise unsupported(
                f"{at}.type",
                f"Content part type {kind!r} is not supported; only 'input_text', 'output_text' and "
                "'input_image' are.",
            )
    if any(part["type"] == "image_url" for part in parts):
        return parts
    return "\n".join(part["text"] for part in parts)


def _text(content: str | list[Any], where: str) -> str:
    """A function call's output: a string, or text parts joined with a newline."""
    text = _content(content, where)
    if not isinstance(text, str):
        raise unsupported(where, "Images are not supported in a function_call_output.")
    return text


def _image(image: InputImage, at: str) -> dict[str, Any]:
    if image.file_id is not None:
        raise unsupported(
            f"{at}.file_id",
            "'file_id' images are not supported: this server stores no files. Send the image as a "
            "data URL (or an http(s) URL) in 'image_url'.",
        )
    if not image.image_url:
        raise InvalidRequestError(
            f"Missing required parameter: '{at}.image_url'.",
            param=f"{at}.image_url",
            code="missing_required_parameter",
        )
    return image_part(image.image_url, image.detail, at)
