"""Llama 3.x's calls: a bare ``{"name": ..., "parameters": {...}}`` answer, or after ``<|python_tag|>``
JSON calls (``;`` between several) or a built-in tool's ``brave_search.call(query="...")``."""

from __future__ import annotations

import ast
import json
from collections.abc import Callable

from sluice.ids import new_tool_call_id
from worker.formats.base import CallSyntax, ParsedCall, Piece, SectionParser, ToolCallStream, json_call
from worker.formats.declaration import CallProbe, JsonCall, ToolFormat
from worker.formats.hermes import ToolCallParser
from worker.formats.pythonic import python_literal

PYTHON_TAG = "<|python_tag|>"


def _json_calls(text: str) -> list[ParsedCall] | None:
    decoder, calls, rest = json.JSONDecoder(), [], text.strip()
    while rest:
        value, end = decoder.raw_decode(rest)
        call = json_call(value)
        if call is None:
            return None
        calls.append(call)
        rest = rest[end:].strip()
        if rest and not rest.startswith(";"):
            return None
        rest = rest[1:].strip()
    return calls or None


def _builtin_call(text: str) -> list[ParsedCall] | None:
    """``tool.call(k="v", ...)``: read with ``ast``, never evaluated."""
    node = ast.parse(text.strip(), mode="eval").body
    if not isinstance(node, ast.Call) or node.args or not isinstance(node.func, ast.Attribute):
        return None
    if node.func.attr != "call" or not isinstance(node.func.value, ast.Name):
        return None
    arguments = {kw.arg: python_literal(kw.value) for kw in node.keywords if kw.arg is not None}
    return [ParsedCall(node.func.value.id, json.dumps(arguments, ensure_ascii=False))]


def parse_python_tag(text: str) -> list[ParsedCall] | None:
    return _json_calls(text) if text.lstrip().startswith("{") else _builtin_call(text)


PYTHON_TAG_CALLS = CallSyntax(start=PYTHON_TAG, parse=parse_python_tag, at_start=True)


class LlamaCalls:
    """``llama3_json``: the answer's start decides, ``<|python_tag|>`` or a bare JSON call."""

    def __init__(self, id_factory: Callable[[], str] = new_tool_call_id):
        self._tagged = SectionParser(PYTHON_TAG_CALLS, id_factory)
        self._bare = ToolCallParser(id_factory=id_factory)
        self._chosen: ToolCallStream | None = None
        self._held = ""
        self.calls = 0

    def push(self, text: str) -> list[Piece]:
        if self._chosen is None:
            self._held += text
            start = self._held.lstrip()
            if not start or (PYTHON_TAG.startswith(start) and start != PYTHON_TAG):
                return []
            self._chosen = self._tagged if start.startswith(PYTHON_TAG) else self._bare
            text, self._held = self._held, ""
        pieces = self._chosen.push(text)
        self.calls = self._chosen.calls
        return pieces

    def finish(self) -> list[Piece]:
        if self._chosen is None:  # only white space or part of the tag: what the bare parser makes of it
            self._chosen, text, self._held = self._bare, self._held, ""
            pieces = [*self._bare.push(text), *self._bare.finish()]
        else:
            pieces = self._chosen.finish()
        self.calls = self._chosen.calls
        return pieces


TOOL_FORMAT = ToolFormat(
    name="llama3_json",
    parser=LlamaCalls,
    grammar=JsonCall((), (), key="parameters"),
    probe=CallProbe(('"parameters"',), rank=3),  # every tool definition has the key too: the last guess
    markers=(PYTHON_TAG,),
    stop_tokens=("<|eom_id|>",),  # ends a built-in tool's call (the turn awaits the result)
)
