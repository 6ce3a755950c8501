"""Nemotron-H's (Nemotron Nano 2's) calls: a JSON list between ``<TOOLCALL>`` and ``</TOOLCALL>``."""

from __future__ import annotations

from worker.formats.base import CallSyntax, SectionParser, json_call_list
from worker.formats.declaration import CallProbe, JsonCall, ToolFormat

OPEN, CLOSE = "<TOOLCALL>", "</TOOLCALL>"
NEMOTRON = CallSyntax(start=OPEN, end=CLOSE, parse=json_call_list)

TOOL_FORMAT = ToolFormat(
    name="nemotron_json",
    parser=lambda: SectionParser(NEMOTRON),
    grammar=JsonCall((OPEN, "["), ("]", CLOSE), separator=", "),
    probe=CallProbe((OPEN,)),
    markers=(OPEN, CLOSE),
)
