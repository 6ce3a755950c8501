"""Structured outputs besides ``response_format``: vLLM's ``structured_outputs`` (and its older
top-level ``guided_*`` fields) and llama.cpp's ``grammar`` (GBNF) and ``json_schema``, each turned
into the worker's ``ResponseFormat``. At most one form per request; the worker compiles it and
names ``response_format.<field>`` in its errors, which :func:`naming_form` renames to the caller's.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from pydantic import Field, StrictBool

from edge.errors import InvalidRequestError
from edge.requests.models import RequestModel
from edge.requests.validation import bad
from sluice.v1 import worker_pb2


class StructuredOutputs(RequestModel):
    """vLLM's ``structured_outputs``: exactly one of its constraint fields."""

    choice: list[str] | None = Field(default=None, description="The output is exactly one of these strings.")
    regex: str | None = Field(
        default=None, description="The whole output matches this regular expression (Rust regex syntax)."
    )
    grammar: str | None = Field(
        default=None, description="A Lark grammar (llguidance's dialect); GBNF (root ::= ...) is also read."
    )
    json_: dict[str, Any] | str | None = Field(
        default=None, alias="json", description="A JSON schema (an object, or its JSON text)."
    )
    structural_tag: dict[str, Any] | str | None = Field(
        default=None,
        description="vLLM's structural tag: {structures: [{begin, schema, end}], triggers: [...]} "
        "(an object, or its JSON text).",
    )
    json_object: StrictBool | None = Field(default=None, description="true: any JSON object.")


class StructuredRequest(RequestModel):
    """The structured-output fields chat and text completions requests share (vLLM's and
    llama.cpp's names)."""

    structured_outputs: StructuredOutputs | None = None
    guided_choice: list[str] | None = Field(
        default=None, description="vLLM's older structured_outputs.choice."
    )
    guided_regex: str | None = Field(default=None, description="vLLM's older structured_outputs.regex.")
    guided_grammar: str | None = Field(default=None, description="vLLM's older structured_outputs.grammar.")
    guided_json: dict[str, Any] | str | None = Field(
        default=None, description="vLLM's older structured_outputs.json."
    )
    grammar: str | None = Field(default=None, description="llama.cpp's GBNF grammar (root ::= ...).")
    json_schema: dict[str, Any] | None = Field(default=None, description="llama.cpp's JSON schema.")

    def structured_form(self, also: str | None = None) -> StructuredForm | None:
        """The one structured-output form set, or None; ``also``: the name of another constraint
        the request sets (``response_format``). Raises a 400 naming the field for two forms, or
        for a form whose value cannot be used."""
        forms = [also] if also else []
        found: StructuredForm | None = None
        for param, value, build in self._candidates():
            if value is None or value is False:
                continue
            forms.append(param)
            if len(forms) > 1:
                raise bad(
                    param,
                    f"only one structured output form may be given, and {forms[0]} is also set",
                )
            found = StructuredForm(param, build(param, value))
        return found

    def _candidates(self) -> Iterator[tuple[str, Any, Callable[[str, Any], worker_pb2.ResponseFormat]]]:
        outputs = self.structured_outputs
        if outputs is not None:
            given = [
                (name, value)
                for name, value in (
                    ("choice", outputs.choice),
                    ("regex", outputs.regex),
                    ("grammar", outputs.grammar),
                    ("json", outputs.json_),
                    ("structural_tag", outputs.structural_tag),
                    ("json_object", outputs.json_object or None),
                )
                if value is not None
            ]
            if len(given) != 1:
                names = ", ".join(name for name, _ in given) or "none"
                raise bad(
                    "structured_outputs",
                    f"give exactly one of choice, regex, grammar, json, structural_tag or json_object "
                    f"(got {names})",
                )
            name, value = given[0]
            yield f"structured_outputs.{name}", value, _BUILDERS[name]
        yield "guided_choice", self.guided_choice, _choice
        yield "guided_regex", self.guided_regex, _regex
        yield "guided_grammar", self.guided_grammar, _lark
        yield "guided_json", self.guided_json, _json
        yield "grammar", self.grammar, _gbnf
        yield "json_schema", self.json_schema, _json


@dataclass(frozen=True)
class StructuredForm:
    """The form a request set: the caller's field (``param``) and the worker's ResponseFormat."""

    param: str
    proto: worker_pb2.ResponseFormat


@contextmanager
def naming_form(form: StructuredForm | None) -> Iterator[None]:
    """Renames the field of a worker's 400 about ``response_format`` (a grammar that does not
    compile) to the field the caller set."""
    try:
        yield
    except InvalidRequestError as error:
        if form is not None and (error.param or "").startswith("response_format"):
            error.param = form.param
        raise


def _choice(param: str, value: list[str]) -> worker_pb2.ResponseFormat:
    if not value:
        raise bad(param, "must hold at least one string")
    return worker_pb2.ResponseFormat(choice=worker_pb2.ChoiceList(choices=value))


def _regex(param: str, value: str) -> worker_pb2.ResponseFormat:
    if not value:
        raise bad(param, "must be a non-empty regular expression")
    return worker_pb2.ResponseFormat(regex=value)


def _lark(param: str, value: str) -> worker_pb2.ResponseFormat:
    if not value.strip():
        raise bad(param, "must be a non-empty grammar")
    return worker_pb2.ResponseFormat(lark=value)


def _gbnf(param: str, value: str) -> worker_pb2.ResponseFormat:
    if not value.strip():
        raise bad(param, "must be a non-empty GBNF grammar")
    return worker_pb2.ResponseFormat(gbnf=value)


def _json(param: str, value: dict[str, Any] | str) -> worker_pb2.ResponseFormat:
    schema = _json_value(param, value, "a JSON schema")
    return worker_pb2.ResponseFormat(
        json_schema=worker_pb2.JsonSchema(name=param, schema_json=_compact(schema), strict=True)
    )


def _structural_tag(param: str, value: dict[str, Any] | str) -> worker_pb2.ResponseFormat:
    tag = _json_value(param, value, "a structural tag")
    return worker_pb2.ResponseFormat(structural_tag_json=_compact(tag))


def _json_object(param: str, value: bool) -> worker_pb2.ResponseFormat:
    return worker_pb2.ResponseFormat(json_object=True)


def _json_value(param: str, value: dict[str, Any] | str, what: str) -> dict[str, Any]:
    """``value`` as a JSON object (given as one, or as its JSON text), else a 400 naming ``param``."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (json.JSONDecodeError, RecursionError) as error:
            raise bad(param, f"is not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise bad(param, f"must be {what} (a JSON object)")
    return value


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


_BUILDERS: dict[str, Callable[[str, Any], worker_pb2.ResponseFormat]] = {
    "choice": _choice,
    "regex": _regex,
    "grammar": _lark,
    "json": _json,
    "structural_tag": _structural_tag,
    "json_object": _json_object,
}
