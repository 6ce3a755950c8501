"""What every request body goes through: JSON-object check, Unicode check, the pydantic
model, and one 400 naming the first bad field (``param``: ``messages[0].role``); the fields
bounded by the contract's ranges (:mod:`sluice.limits`).
"""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, Field, ValidationError
from pydantic_core import PydanticCustomError

from edge.errors import InvalidRequestError, UnprocessableEntityError
from sluice.limits import INT32_MAX, Range

ModelT = TypeVar("ModelT", bound=BaseModel)


_TokenIds = Annotated[list[Annotated[int, Field(ge=0, le=INT32_MAX)]], Field(min_length=1)]
_Text = Annotated[str, Field(min_length=1)]


def text_or_tokens_shapes(most: int) -> Any:
    """The four shapes of OpenAI's ``prompt`` and ``input`` fields as the OpenAPI document shows them
    (a text, texts, token ids, lists of token ids; at most ``most`` items), for a before-validator's
    ``json_schema_input_type``."""
    return (
        _Text
        | Annotated[list[_Text], Field(min_length=1, max_length=most)]
        | _TokenIds
        | Annotated[list[_TokenIds], Field(min_length=1, max_length=most)]
    )


def in_range(accepted: Range, **field: Any) -> Any:
    """An optional number field accepting the contract's range ``accepted`` (:mod:`sluice.limits`):
    ``temperature: float | None = in_range(TEMPERATURE)``; ``field``: more of ``Field``'s arguments."""
    low_open = accepted.low_open
    return Field(
        default=None,
        ge=None if low_open else accepted.low,
        gt=accepted.low if low_open else None,
        le=accepted.high,
        **field,
    )


def invalid(message: str) -> PydanticCustomError:
    """A validation error reported with ``code: invalid_value`` and ``message``."""
    return PydanticCustomError("invalid_value", message)


#: OpenAI's metadata limits: 16 pairs, keys up to 64 characters, values up to 512.
MAX_METADATA = (16, 64, 512)


def metadata_limits(value: dict[str, str] | None) -> dict[str, str] | None:
    """A ``metadata`` field validator: OpenAI's limits (:data:`MAX_METADATA`)."""
    pairs, key_length, value_length = MAX_METADATA
    if value is not None and (
        len(value) > pairs or any(len(k) > key_length or len(v) > value_length for k, v in value.items())
    ):
        raise invalid(
            f"at most {pairs} pairs, keys up to {key_length} characters, values up to {value_length}"
        )
    return value


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
    if getattr(request, "stream_options", None) is not None and not getattr(request, "stream", False):
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
    """The body path of an error's location; a union member's tag (``<parts>``) is no part of it."""
    path = ""
    for part in loc:
        if isinstance(part, str) and part.startswith("<"):
            continue
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


def _to_invalid_request(error: ValidationError) -> InvalidRequestError:
    """Reports the first validation error, OpenAI style."""
    first = error.errors(include_url=False)[0]
    param = _param_path(tuple(first["loc"])) or None
    kind = first["type"]
    if kind == "unknown_field":  # --strict-fields (edge.requests.models)
        param = _param_path((*first["loc"], first["ctx"]["field"]))
        return InvalidRequestError(
            f"Unrecognized request argument supplied: '{param}'.", param=param, code="unknown_parameter"
        )
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
