"""The two pydantic bases of the edge's wire models: one for request bodies, one for answers."""

from __future__ import annotations

import functools
from contextvars import ContextVar
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, model_validator
from pydantic_core import PydanticCustomError

# ``--strict-fields``: the edge app sets it per request (a field no model knows is then a 400).
strict_fields: ContextVar[bool] = ContextVar("sluice_strict_fields", default=False)


class RequestModel(BaseModel):
    """A request body or part: NaN and infinities refused; unknown fields ignored, or, under
    ``--strict-fields``, refused (but those in ``ignored_fields``, no-ops listed in docs/http.md)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    ignored_fields: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, data: Any) -> Any:
        if isinstance(data, dict) and strict_fields.get():
            known = _known_names(cls)
            for key in data:
                if key not in known:
                    raise PydanticCustomError(
                        "unknown_field", "Unrecognized request argument supplied", {"field": key}
                    )
        return data


@functools.cache
def _known_names(model: type[RequestModel]) -> frozenset[str]:
    """The body keys ``model`` takes: its fields, their aliases and its ignored fields."""
    fields = model.model_fields
    return frozenset(fields) | {f.alias for f in fields.values() if f.alias} | model.ignored_fields


class ResponseModel(BaseModel):
    """An answer body or part (the OpenAPI document's response schemas): no extra fields."""

    model_config = ConfigDict(extra="forbid")
