"""The OpenAI chat completions request, validated, and the parts every request shares.

:func:`parse_chat_request` is the entry point for ``POST /v1/chat/completions``
(:mod:`edge.completion_types` has the one for ``/v1/completions``). Both go
through :func:`validate_body`, which turns a decoded JSON body into a model or
raises:

- :class:`~edge.errors.UnprocessableEntityError` (422) when the body is valid
  JSON but not a JSON object;
- :class:`~edge.errors.InvalidRequestError` (400) whose ``param`` is the field
  path (``temperature``, ``messages[0].role``) and whose ``code`` is
  ``missing_required_parameter``, ``invalid_type`` or ``invalid_value``.

Unknown fields are ignored; booleans are strict (``"yes"`` is not ``true``).
Operator limits (:class:`RequestLimits`: messages, prompt characters, ``n``,
``max_tokens``, ``top_logprobs``) are checked after the shape, with the same
400 naming the field. They come from the ``limits`` argument, else from
:data:`request_limits`, which the app sets per request from its settings
(the built-in defaults outside a request).

Union-shaped OpenAI fields (``content``, ``stop``, ``tool_choice``) are
normalized to one shape by "before" validators,
so error locations never contain pydantic's union tags and later code sees a
single type; each such validator declares the wire shape as its
``json_schema_input_type``, so the OpenAPI document (:mod:`edge.openapi`)
shows what callers send, not the normalized form.
"""

from __future__ import annotations

import re
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError, field_validator
from pydantic_core import PydanticCustomError

from edge.errors import InvalidRequestError, UnprocessableEntityError

# Seeds: any int64 (OpenAI) or uint64 (the proto) value.
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1
# The largest value of a proto ``int32`` field (max_tokens, token ids, logprobs ...): a larger
# number cannot travel to the worker, so the schema refuses it with a 400 naming the field.
INT32_MAX = 2**31 - 1
_FUNCTION_NAME = "^[A-Za-z0-9_.\\-]{1,64}$"  # also the OpenAPI document's pattern (ECMA syntax)

Role = Literal["system", "developer", "user", "assistant", "tool"]
ModelT = TypeVar("ModelT", bound=BaseModel)


# Hard ceilings of the request schema; operator limits may only lower them.
MAX_N = 128
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class RequestLimits:
    """Per-request bounds an operator tunes (``--max-messages`` and friends, see docs/http.md).

    ``max_prompt_chars`` counts the characters of every message's text
    (``content``, ``reasoning_content``, tool-call ``arguments``) of a chat
    request, or of every prompt of a completions request (a token-id prompt
    counts one per id). ``max_tokens`` bounds ``max_tokens`` and
    ``max_completion_tokens`` when a request sets them; 0 means no bound at
    the edge (the worker still bounds them by the context length). ``n`` is
    per prompt. ``__post_init__`` raises ``ValueError`` naming a bad field.
    """

    max_messages: int = 1024
    max_prompt_chars: int = 1_000_000
    max_n: int = MAX_N
    max_tokens: int = 0
    max_top_logprobs: int = MAX_TOP_LOGPROBS

    def __post_init__(self) -> None:
        for name, low, high in (
            ("max_messages", 1, None),
            ("max_prompt_chars", 1, None),
            ("max_n", 1, MAX_N),
            ("max_tokens", 0, None),
            ("max_top_logprobs", 0, MAX_TOP_LOGPROBS),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name}: must be an integer >= {low}, got {value!r}")
            if high is not None and value > high:
                raise ValueError(f"{name}: must be at most {high}, got {value}")


DEFAULT_LIMITS = RequestLimits()
# The limits of the request being parsed; the edge app sets it per request (None: the defaults).
request_limits: ContextVar[RequestLimits | None] = ContextVar("sluice_request_limits", default=None)


def active_limits() -> RequestLimits:
    """The limits set for this context, else :data:`DEFAULT_LIMITS`."""
    return request_limits.get() or DEFAULT_LIMITS


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


def invalid(message: str) -> PydanticCustomError:
    """A validation error reported with ``code: invalid_value`` and ``message``."""
    return PydanticCustomError("invalid_value", message)


# ------------------------------------------------------------ shared fields


class StreamOptions(_Model):
    """``stream_options``; only allowed with ``stream: true``."""

    include_usage: StrictBool = Field(
        default=False, description="End the stream with one chunk carrying the total usage (choices: [])."
    )
    continuous_usage_stats: StrictBool = Field(
        default=False,
        description="vLLM's extension: every chunk carries the usage so far (completion tokens counted "
        "per choice and summed).",
    )


class SamplingRequest(_Model):
    """Fields shared by chat and text completions requests."""

    model: str
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    n: int | None = Field(default=None, ge=1, le=MAX_N)
    stop: list[str] | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    seed: int | None = Field(default=None, ge=_SEED_MIN, le=_SEED_MAX)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = Field(
        default=None,
        json_schema_extra={
            "propertyNames": {"pattern": "^[0-9]{1,10}$"},
            "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
        },
    )
    user: str | None = None
    # Extensions with vLLM's names and meanings (the SDKs send them through ``extra_body``): run past
    # the model's end-of-sequence token, and generate at least this many tokens.
    ignore_eos: StrictBool | None = None
    min_tokens: int | None = Field(default=None, ge=0, le=INT32_MAX)

    @field_validator("stop", mode="before", json_schema_input_type=str | list[str] | None)
    @classmethod
    def _stop_as_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias_range(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not (key.isascii() and key.isdigit()) or not 0 <= int(key) <= INT32_MAX:
                raise invalid(f"key {key!r} is not a token id")
            if not -100 <= bias <= 100:
                raise invalid(f"bias {bias} for token {key} is not in [-100, 100]")
        return value

    @property
    def include_usage(self) -> bool:
        """Whether a streamed answer ends with a usage chunk."""
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Whether every streamed chunk carries the usage so far."""
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    @property
    def choices_per_prompt(self) -> int:
        return self.n if self.n is not None else 1


# --------------------------------------------------------------------- chat


class TextPart(_Model):
    """One part of an array ``content``; only text parts are supported."""

    type: Literal["text"]
    text: str


def _join_text_parts(value: Any) -> Any:
    """An array of ``{"type": "text", "text": ...}`` parts becomes one string.

    Parts are joined with a newline, as vLLM does, so separate parts never run
    together into one word.
    """
    if not isinstance(value, list):
        return value
    texts: list[str] = []
    for i, part in enumerate(value):
        if not isinstance(part, dict):
            raise invalid(f"content[{i}] must be an object like {{'type': 'text', 'text': '...'}}")
        if part.get("type") != "text":
            raise invalid(f"content[{i}].type {part.get('type')!r} is not supported; only 'text' parts are")
        text = part.get("text")
        if not isinstance(text, str):
            raise invalid(f"content[{i}].text must be a string")
        texts.append(text)
    return "\n".join(texts)


class FunctionCall(_Model):
    name: str
    # JSON text, as OpenAI sends it; passed through untouched.
    arguments: str


class AssistantToolCall(_Model):
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


class ChatMessage(_Model):
    """One conversation turn. Role-specific rules are checked in :func:`parse_chat_request`
    (and shown in the OpenAPI document by :func:`_document_role_rules`)."""

    model_config = ConfigDict(json_schema_extra=_document_role_rules)

    role: Role
    content: str | None = None
    name: str | None = None
    tool_calls: list[AssistantToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    _text_parts = field_validator(
        "content", mode="before", json_schema_input_type=str | list[TextPart] | None
    )(_join_text_parts)


class FunctionDefinition(_Model):
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


class ToolDefinition(_Model):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Model):
    name: str = Field(min_length=1)


class NamedToolChoice(_Model):
    """``{"type": "function", "function": {"name": ...}}`` (the wire shape, for the schema)."""

    type: Literal["function"]
    function: NamedFunction


class ToolChoice(_Model):
    """``"none" | "auto" | "required"`` or a named function, in one shape."""

    mode: Literal["none", "auto", "required", "function"]
    function_name: str | None = None


class JsonSchemaFormat(_Model):
    name: str
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(_Model):
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


class ChatCompletionRequest(SamplingRequest):
    """A validated ``POST /v1/chat/completions`` body (see the module docstring)."""

    model_config = ConfigDict(json_schema_extra=_document_chat_rules)

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
    # does the same); other values leave the model's default.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
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
    check_chat_limits(request, limits or active_limits())
    return request


def check_chat_limits(request: ChatCompletionRequest, limits: RequestLimits) -> None:
    """Raises a 400 naming the field when ``request`` is over one of ``limits``."""
    if len(request.messages) > limits.max_messages:
        raise bad(
            "messages", f"at most {limits.max_messages} messages per request, got {len(request.messages)}"
        )
    chars = 0
    for message in request.messages:
        chars += len(message.content or "") + len(message.reasoning_content or "")
        chars += sum(len(call.function.arguments) for call in message.tool_calls or ())
    if chars > limits.max_prompt_chars:
        raise bad(
            "messages",
            f"the messages hold {chars} characters of text; at most {limits.max_prompt_chars} are accepted",
        )
    check_sampling_limits(request, limits)
    if request.max_completion_tokens is not None and limits.max_tokens:
        _check_max_tokens("max_completion_tokens", request.max_completion_tokens, limits)
    if request.top_logprobs is not None and request.top_logprobs > limits.max_top_logprobs:
        raise bad("top_logprobs", f"must be at most {limits.max_top_logprobs}, got {request.top_logprobs}")


def check_sampling_limits(request: SamplingRequest, limits: RequestLimits) -> None:
    """The limits on fields both APIs share: ``n`` and ``max_tokens``."""
    if request.n is not None and request.n > limits.max_n:
        raise bad("n", f"must be at most {limits.max_n}, got {request.n}")
    if request.max_tokens is not None and limits.max_tokens:
        _check_max_tokens("max_tokens", request.max_tokens, limits)


def _check_max_tokens(param: str, value: int, limits: RequestLimits) -> None:
    if value > limits.max_tokens:
        raise bad(param, f"must be at most {limits.max_tokens}, got {value}")


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


# --------------------------------------------------------------- validation


def validate_body(model: type[ModelT], body: Any) -> ModelT:
    """Validates a decoded JSON body against ``model`` and the rules every request shares.

    Raises :class:`UnprocessableEntityError` when ``body`` is not a JSON object
    and :class:`InvalidRequestError` naming the first bad field otherwise.
    """
    if not isinstance(body, dict):
        raise UnprocessableEntityError(
            f"The request body must be a JSON object, got {_json_type(body)}.", code="invalid_type"
        )
    check_unicode(body)
    try:
        request = model.model_validate(body)
    except ValidationError as error:
        raise _to_invalid_request(error) from None
    if isinstance(request, SamplingRequest) and request.stream_options is not None and not request.stream:
        raise bad("stream_options", "stream_options is only allowed when stream is true")
    return request


def check_unicode(body: dict[str, Any]) -> None:
    """Raises a 400 naming the first string (value or key) that is not valid Unicode.

    JSON's ``\\ud800`` escapes decode to lone surrogates, which cannot be encoded
    as UTF-8: they would fail later, in the protobuf message or the tokenizer.
    The walk is iterative, so a body nested as deep as the JSON parser allows
    cannot exhaust the stack here.
    """
    pending: list[tuple[str, Any]] = [("", body)]
    while pending:
        path, value = pending.pop()
        if isinstance(value, str):
            if not _encodes(value):
                raise _bad_unicode(path or "body")
        elif isinstance(value, dict):
            for key, item in value.items():
                child = f"{path}.{key}" if path else key
                if not _encodes(key):
                    raise _bad_unicode(path or "body")
                pending.append((child, item))
        elif isinstance(value, list):
            pending.extend((f"{path}[{i}]", item) for i, item in enumerate(value))


def _encodes(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _bad_unicode(param: str) -> InvalidRequestError:
    return InvalidRequestError(
        f"Invalid '{param}': the string holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff "
        "escape), which is not valid Unicode.",
        param=param,
        code="invalid_value",
    )


def _json_type(value: Any) -> str:
    if isinstance(value, list):
        return "an array"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    return "null" if value is None else type(value).__name__


def _param_path(loc: tuple[int | str, ...]) -> str:
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


def _to_invalid_request(error: ValidationError) -> InvalidRequestError:
    """Reports the first validation error, OpenAI style."""
    first = error.errors(include_url=False)[0]
    param = _param_path(tuple(first["loc"])) or None
    kind = first["type"]
    if kind == "missing":
        return InvalidRequestError(
            f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter"
        )
    if kind == "too_short" and first.get("input") == []:
        # OpenAI's own wording and code for an empty array (``messages``, ``tools``).
        return InvalidRequestError(
            f"Invalid '{param}': empty array. Expected an array with minimum length 1, "
            "but got an empty array instead.",
            param=param,
            code="empty_array",
        )
    code = (
        "invalid_type"
        if kind.endswith(("_type", "_parsing")) or kind == "int_from_float"
        else "invalid_value"
    )
    return InvalidRequestError(f"Invalid '{param}': {first['msg']}.", param=param, code=code)


def bad(param: str, message: str) -> InvalidRequestError:
    """A 400 ``invalid_value`` naming ``param``."""
    return InvalidRequestError(f"Invalid '{param}': {message}.", param=param, code="invalid_value")


def missing(param: str, message: str) -> InvalidRequestError:
    """A 400 ``missing_required_parameter`` naming ``param``."""
    return InvalidRequestError(
        f"Missing required parameter: '{param}' ({message}).", param=param, code="missing_required_parameter"
    )
