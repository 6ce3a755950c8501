"""The OpenAI chat completions request: the chat surface's body, and the one request form the
Responses, Anthropic and native surfaces are rewritten into (:mod:`edge.surfaces.shared.rewrite`).

:func:`parse_chat_request` validates a decoded body fully (:mod:`edge.requests.validation`).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Discriminator, Field, PrivateAttr, StrictBool, Tag, field_validator
from pydantic_core import PydanticCustomError

from edge.errors import InvalidRequestError
from edge.requests.limits import RequestLimits, active_limits
from edge.requests.models import RequestModel
from edge.requests.validation import bad, invalid, missing, validate_body
from edge.surfaces.shared.images import Image, decode_data_url, is_remote
from edge.surfaces.shared.sampling import SamplingRequest, check_max_tokens, check_sampling_limits
from edge.surfaces.shared.structured import StructuredForm, StructuredRequest
from sluice.limits import INT32_MAX, MAX_TOP_LOGPROBS

_FUNCTION_NAME = "^[A-Za-z0-9_.\\-]{1,64}$"  # also the OpenAPI document's pattern (ECMA syntax)

Role = Literal["system", "developer", "user", "assistant", "tool"]


class TextPart(RequestModel):
    """A text part of an array ``content``."""

    type: Literal["text"]
    text: str


class ImageUrl(RequestModel):
    url: str = Field(min_length=1)
    detail: Literal["auto", "low", "high"] | None = None


class ImageUrlPart(RequestModel):
    """An image part of an array ``content``: a ``data:`` URL (decoded when the request is parsed)
    or an ``http(s)`` URL (fetched before the worker call, where the operator allows it)."""

    type: Literal["image_url"]
    image_url: ImageUrl
    # The image's bytes: decoded from a data URL at parse time, or fetched (edge.surfaces.images).
    _image: Image | None = PrivateAttr(default=None)

    @field_validator("image_url", mode="before", json_schema_input_type=ImageUrl)
    @classmethod
    def _url_string(cls, value: Any) -> Any:
        """A bare URL string (as some clients send it) is taken as ``{"url": ...}``."""
        return {"url": value} if isinstance(value, str) else value

    @property
    def image(self) -> Image | None:
        return self._image

    def resolve(self, image: Image) -> None:
        self._image = image


# A part, by its type; a message's content: a string or parts, by its JSON type. So an error in a
# part names the part (the tags, in angle brackets, are left out of an error's path).
ContentPart = Annotated[
    Annotated[TextPart, Tag("<text>")] | Annotated[ImageUrlPart, Tag("<image_url>")],
    Discriminator(lambda value: f"<{value.get('type') if isinstance(value, dict) else value.type}>"),
]
Content = Annotated[
    Annotated[str, Tag("<string>")] | Annotated[list[ContentPart], Tag("<parts>")],
    Discriminator(lambda value: "<parts>" if isinstance(value, list) else "<string>"),
]
_PART_TYPES = ("text", "image_url")


def _content_parts(value: Any) -> Any:
    """An array of text parts becomes one string, joined with a newline as vLLM does (so separate
    parts never run together into one word): text-only requests reach the worker as before. An
    array with an image part stays an array (its parts in order)."""
    if not isinstance(value, list):
        if value is not None and not isinstance(value, str):
            raise PydanticCustomError("content_type", "must be a string or an array of content parts")
        return value
    texts: list[str] = []
    for i, part in enumerate(value):
        if not isinstance(part, dict):
            raise invalid(f"content[{i}] must be an object like {{'type': 'text', 'text': '...'}}")
        if part.get("type") not in _PART_TYPES:
            raise invalid(
                f"content[{i}].type {part.get('type')!r} is not supported; "
                "only 'text' and 'image_url' parts are"
            )
        if part["type"] == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise invalid(f"content[{i}].text must be a string")
            texts.append(text)
    return "\n".join(texts) if len(texts) == len(value) else value


class FunctionCall(RequestModel):
    name: str
    # JSON text, as OpenAI sends it; passed through untouched.
    arguments: str


class AssistantToolCall(RequestModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


_NOT_NULL: dict[str, Any] = {"not": {"type": "null"}}
_NO_TOOL_CALLS: dict[str, Any] = {"anyOf": [{"type": "null"}, {"type": "array", "maxItems": 0}]}


def _document_role_rules(schema: dict[str, Any]) -> None:
    """The per-role rules of :func:`_check_chat_semantics`, in the OpenAPI document: content
    for every role but an assistant calling tools, ``tool_call_id`` for tool messages,
    ``tool_calls`` only on assistant messages."""
    schema["anyOf"] = [
        {
            "properties": {
                "role": {"enum": ["system", "developer", "user"]},
                "content": _NOT_NULL,
                "tool_calls": _NO_TOOL_CALLS,
            },
            "required": ["role", "content"],
        },
        {
            "properties": {
                "role": {"const": "tool"},
                "content": _NOT_NULL,
                "tool_call_id": {"type": "string", "minLength": 1},
                "tool_calls": _NO_TOOL_CALLS,
            },
            "required": ["role", "content", "tool_call_id"],
        },
        {
            "properties": {"role": {"const": "assistant"}, "content": _NOT_NULL},
            "required": ["role", "content"],
        },
        {
            "properties": {"role": {"const": "assistant"}, "tool_calls": {"type": "array", "minItems": 1}},
            "required": ["role", "tool_calls"],
        },
    ]


class ChatMessage(RequestModel):
    """One conversation turn. Role-specific rules are checked in :func:`parse_chat_request`
    (and shown in the OpenAPI document by :func:`_document_role_rules`)."""

    model_config = ConfigDict(json_schema_extra=_document_role_rules)

    role: Role
    content: Content | None = None
    name: str | None = None
    tool_calls: list[AssistantToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    _parts = field_validator("content", mode="before", json_schema_input_type=str | list[ContentPart] | None)(
        _content_parts
    )

    def text_chars(self) -> int:
        """Characters of text in ``content`` (its text parts, when it is an array)."""
        if isinstance(self.content, list):
            return sum(len(part.text) for part in self.content if isinstance(part, TextPart))
        return len(self.content or "")


class FunctionDefinition(RequestModel):
    name: str = Field(json_schema_extra={"pattern": _FUNCTION_NAME})
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None

    @field_validator("name")
    @classmethod
    def _name_shape(cls, value: str) -> str:
        if not re.fullmatch(_FUNCTION_NAME[1:-1], value):
            raise invalid("must be 1-64 characters of a-z, A-Z, 0-9, '_', '.' or '-'")
        return value


class ToolDefinition(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: str = Field(min_length=1)


class NamedToolChoice(RequestModel):
    """``{"type": "function", "function": {"name": ...}}`` (the wire shape, for the schema)."""

    type: Literal["function"]
    function: NamedFunction


class ToolChoice(RequestModel):
    """``"none" | "auto" | "required"`` or a named function, in one shape."""

    mode: Literal["none", "auto", "required", "function"]
    function_name: str | None = None


class JsonSchemaFormat(RequestModel):
    name: str
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


def _requires(field: str, then: dict[str, Any]) -> dict[str, Any]:
    """JSON Schema: when ``field`` is set (not null), ``then`` applies."""
    return {"if": {"required": [field], "properties": {field: _NOT_NULL}}, "then": then}


def _true(field: str) -> dict[str, Any]:
    return {"required": [field], "properties": {field: {"const": True}}}


def _document_chat_rules(schema: dict[str, Any]) -> None:
    """The cross-field rules of :func:`_check_chat_semantics` and :func:`validate_body` that JSON
    Schema can say, in the OpenAPI document (a named ``tool_choice`` must also name one of
    ``tools``, which it cannot)."""
    schema["allOf"] = [
        _requires("stream_options", _true("stream")),
        _requires("top_logprobs", _true("logprobs")),
        _requires("tool_choice", {"required": ["tools"], "properties": {"tools": _NOT_NULL}}),
        {
            "if": {
                "required": ["response_format"],
                "properties": {
                    "response_format": {
                        "type": "object",
                        "required": ["type"],
                        "properties": {"type": {"const": "json_schema"}},
                    }
                },
            },
            "then": {
                "properties": {
                    "response_format": {"required": ["json_schema"], "properties": {"json_schema": _NOT_NULL}}
                }
            },
        },
    ]


class ChatCompletionRequest(SamplingRequest, StructuredRequest):
    """A validated ``POST /v1/chat/completions`` body (docs/edge-internals.md, "Request validation")."""

    model_config = ConfigDict(json_schema_extra=_document_chat_rules)
    # OpenAI's fields with no effect here (docs/http.md), and those parse_chat_request refuses itself.
    ignored_fields = frozenset(
        {"store", "service_tier", "prompt_cache_key", "safety_identifier", "prediction", "modalities"}
        | {"functions", "function_call", "audio"}
    )

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    logprobs: StrictBool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ToolDefinition] | None = Field(default=None, min_length=1)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    response_format: ResponseFormat | None = None
    metadata: dict[str, str] | None = None
    # Reasoning models: "none" turns thinking off (vLLM's and SGLang's `chat_template_kwargs.enable_thinking`
    # does the same); the others are the family's own effort switch (gpt-oss), else a thinking budget.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    # vLLM's cap on each choice's thinking tokens: the worker then ends the thinking with the family's
    # own marker and the answer follows (docs/http.md, "Chat completions request").
    thinking_token_budget: int | None = Field(default=None, ge=0, le=INT32_MAX)
    # Extra variables for the model's chat template (a vLLM extension).
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator(
        "tool_choice",
        mode="before",
        json_schema_input_type=Literal["none", "auto", "required"] | NamedToolChoice | None,
    )
    @classmethod
    def _tool_choice_shape(cls, value: Any) -> Any:
        if value is None:
            return None
        if isinstance(value, str):
            if value not in ("none", "auto", "required"):
                raise invalid("must be 'none', 'auto', 'required' or {'type': 'function', ...}")
            return {"mode": value}
        if isinstance(value, dict):
            function = value.get("function")
            name = function.get("name") if isinstance(function, dict) else None
            if value.get("type") != "function" or not isinstance(name, str) or not name:
                raise invalid("a named tool choice must be {'type': 'function', 'function': {'name': ...}}")
            return {"mode": "function", "function_name": name}
        raise invalid("must be a string or an object")

    # Where the caller's surface put each image part (edge.surfaces.shared.rewrite.to_chat_request):
    # ``messages[i].content[j]`` → the surface's own path; empty for the chat surface.
    _places: dict[str, str] = PrivateAttr(default_factory=dict)

    def keep_places(self, places: Mapping[str, str]) -> None:
        """Remembers where the caller's surface put each image part (chat path → surface path)."""
        self._places = dict(places)

    def surface_param(self, param: str) -> str:
        """``param`` (a path in this chat request) as the caller's surface names it."""
        return placed_param(param, self._places) or param

    def image_parts(self) -> Iterator[tuple[str, ImageUrlPart]]:
        """Every image part, in order, with its path in this request (``messages[i].content[j]``)."""
        for i, message in enumerate(self.messages):
            if isinstance(message.content, list):
                for j, part in enumerate(message.content):
                    if isinstance(part, ImageUrlPart):
                        yield f"messages[{i}].content[{j}]", part

    def structured(self) -> StructuredForm | None:
        """The structured-output form besides ``response_format`` (:mod:`edge.surfaces.shared.structured`)."""
        fmt = self.response_format
        return self.structured_form("response_format" if fmt is not None and fmt.type != "text" else None)

    @property
    def completion_token_limit(self) -> int | None:
        """``max_completion_tokens`` (the current name) wins over ``max_tokens``."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# Known OpenAI chat fields that cannot be honoured: ignoring them would change
# the answer's meaning, so they are refused instead (param: the field).
_UNSUPPORTED_CHAT_FIELDS = {
    "functions": "'functions' (deprecated) is not supported; use 'tools'.",
    "function_call": "'function_call' (deprecated) is not supported; use 'tool_choice'.",
    "audio": "'audio': audio output is not supported.",
}


def placed_param(param: str, places: Mapping[str, str]) -> str | None:
    """``param`` with its leading path renamed by ``places`` (chat path → the surface's path; the
    first place that is ``param`` or a path above it); ``None`` when no place is."""
    for chat_path, surface_path in places.items():
        if param == chat_path or param.startswith((f"{chat_path}.", f"{chat_path}[")):
            return surface_path + param[len(chat_path) :]
    return None


def parse_chat_request(body: Any, limits: RequestLimits | None = None) -> ChatCompletionRequest:
    """Validates a decoded JSON body fully, ``limits`` (default: :func:`active_limits`)
    included; raises :class:`InvalidRequestError` (or :class:`UnprocessableEntityError`
    for a non-object body)."""
    request = validate_body(ChatCompletionRequest, body)
    for name, message in _UNSUPPORTED_CHAT_FIELDS.items():
        if body.get(name) is not None:
            raise InvalidRequestError(message, param=name, code="unsupported_parameter")
    modalities = body.get("modalities")
    if isinstance(modalities, list) and any(m != "text" for m in modalities):
        raise InvalidRequestError(
            "'modalities': only 'text' output is supported.", param="modalities", code="unsupported_parameter"
        )
    _check_chat_semantics(request)
    request.structured()
    limits = limits or active_limits()
    check_chat_limits(request, limits)
    decode_images(request, limits)
    return request


def decode_images(request: ChatCompletionRequest, limits: RequestLimits) -> None:
    """Decodes every data-URL image part and checks the image limits; an ``http(s)`` URL is left for
    the fetch before the worker call, when the operator allows them. Each error is a 400 naming
    the part (``messages[i].content[j]``)."""
    for count, (param, part) in enumerate(request.image_parts(), 1):
        if count > limits.max_images:
            raise bad(param, f"at most {limits.max_images} images are accepted per request")
        url = part.image_url.url
        if is_remote(url) and limits.allow_image_urls:
            continue
        try:
            part.resolve(decode_data_url(url, limits.max_image_bytes))
        except ValueError as error:
            raise bad(param, str(error)) from None


def check_chat_limits(request: ChatCompletionRequest, limits: RequestLimits) -> None:
    """Raises a 400 naming the field when ``request`` is over one of ``limits``."""
    if len(request.messages) > limits.max_messages:
        raise bad(
            "messages", f"at most {limits.max_messages} messages per request, got {len(request.messages)}"
        )
    chars = 0
    for message in request.messages:
        chars += message.text_chars() + len(message.reasoning_content or "")
        chars += sum(len(call.function.arguments) for call in message.tool_calls or ())
    if chars > limits.max_prompt_chars:
        raise bad(
            "messages",
            f"the messages hold {chars} characters of text; at most {limits.max_prompt_chars} are accepted",
        )
    check_sampling_limits(request, limits)
    if request.max_completion_tokens is not None and limits.max_tokens:
        check_max_tokens("max_completion_tokens", request.max_completion_tokens, limits)
    if request.top_logprobs is not None and request.top_logprobs > limits.max_top_logprobs:
        raise bad("top_logprobs", f"must be at most {limits.max_top_logprobs}, got {request.top_logprobs}")


def _check_chat_semantics(request: ChatCompletionRequest) -> None:
    """Rules that span fields; each error names the exact field."""
    for i, message in enumerate(request.messages):
        where = f"messages[{i}]"
        if message.role == "assistant":
            if message.content is None and not message.tool_calls:
                raise missing(f"{where}.content", "an assistant message needs content or tool_calls")
            continue
        if message.tool_calls:
            raise bad(
                f"{where}.tool_calls", f"only assistant messages may have tool_calls, not {message.role}"
            )
        if message.content is None:
            raise missing(f"{where}.content", f"a {message.role} message needs content")
        if message.role == "tool" and not message.tool_call_id:
            raise missing(f"{where}.tool_call_id", "a tool message needs the tool_call_id it answers")
    if request.top_logprobs is not None and not request.logprobs:
        raise bad("top_logprobs", "top_logprobs requires logprobs to be true")
    choice = request.tool_choice
    if choice is not None and request.tools is None:
        raise InvalidRequestError(
            "Invalid value for 'tool_choice': 'tool_choice' is only allowed when 'tools' are specified.",
            param="tool_choice",
            code="invalid_value",
        )
    tool_names = [tool.function.name for tool in request.tools or ()]
    if choice is not None and choice.mode == "function" and choice.function_name not in tool_names:
        raise bad("tool_choice", f"function {choice.function_name!r} is not in tools")
    if len(set(tool_names)) != len(tool_names):
        raise bad("tools", "tool function names must be unique")
    fmt = request.response_format
    if fmt is not None and fmt.type == "json_schema" and fmt.json_schema is None:
        raise missing("response_format.json_schema", "response_format of type json_schema needs json_schema")
