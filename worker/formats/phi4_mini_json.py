"""Phi-4-mini's calls: a JSON list after ``functools`` (``functools[{"name": ..., "arguments": {...}}]``)."""

from __future__ import annotations

from worker.formats.base import CallSyntax, SectionParser, json_call_list
from worker.formats.declaration import CallProbe, JsonCall, ToolFormat

PHI4_MINI = CallSyntax(start="functools", parse=json_call_list)

TOOL_FORMAT = ToolFormat(
    name="phi4_mini_json",
    parser=lambda: SectionParser(PHI4_MINI),
    grammar=JsonCall(("functools[",), ("]",)),
    probe=CallProbe(("functools[",)),
    markers=(),  # plain text in its vocabulary
)
