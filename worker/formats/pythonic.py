"""Llama 3.2's pythonic calls: ``[get_weather(city="Paris"), get_time()]`` at the start of the answer.

Read with ``ast`` (never evaluated); JSON's ``true``/``false``/``null`` are accepted as literals.
"""

from __future__ import annotations

import ast
import json
from typing import Any

from worker.formats.base import CallSyntax, ParsedCall, SectionParser
from worker.formats.declaration import CallProbe, TaggedCall, ToolFormat

_JSON_NAMES = {"true": True, "false": False, "null": None}


def python_literal(node: ast.expr) -> Any:
    """A literal argument (JSON's names accepted); anything else raises ValueError."""
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.List | ast.Tuple):
        return [python_literal(item) for item in node.elts]
    if isinstance(node, ast.Dict):
        return {
            python_literal(k): python_literal(v)
            for k, v in zip(node.keys, node.values, strict=True)
            if k is not None
        }
    return ast.literal_eval(node)


def parse_pythonic(text: str) -> list[ParsedCall] | None:
    tree = ast.parse(text.strip(), mode="eval").body
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or node.args:
            return None
        name = ast.unparse(node.func)
        if not all(part.isidentifier() for part in name.split(".")):
            return None
        arguments = {kw.arg: python_literal(kw.value) for kw in node.keywords if kw.arg is not None}
        calls.append(ParsedCall(name, json.dumps(arguments, ensure_ascii=False)))
    return calls


PYTHONIC = CallSyntax(start="[", parse=parse_pythonic, at_start=True, start_in_body=True)

TOOL_FORMAT = ToolFormat(
    name="pythonic",
    parser=lambda: SectionParser(PYTHONIC),
    # Python's argument list: every parameter given, so no separator is left dangling.
    grammar=TaggedCall(
        "{name}(", "{key}=", "", ")", ", ", parameter_separator=", ", every_parameter=True, around=("[", "]")
    ),
    probe=CallProbe(("{tool}(",), rank=2),  # a template's tool listing may show signatures too
    markers=(),
)
