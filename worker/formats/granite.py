"""Granite's calls, a JSON list after ``<|tool_call|>``, and its thinking: ``<think>``…``</think>``, then
the answer in ``<response>``…``</response>``."""

from __future__ import annotations

from worker.formats.base import CallSyntax, SectionParser, json_call_list
from worker.formats.declaration import CallProbe, JsonCall, ToolFormat
from worker.formats.think import ThinkMarkers, think_format, thinks

TOOL_CALL = "<|tool_call|>"
GRANITE = CallSyntax(start=TOOL_CALL, parse=json_call_list)

TOOL_FORMAT = ToolFormat(
    name="granite",
    parser=lambda: SectionParser(GRANITE),
    grammar=JsonCall((TOOL_CALL, "["), ("]",)),
    probe=CallProbe((TOOL_CALL,)),
    markers=(TOOL_CALL,),
    model_types=("granite",),  # its template renders no earlier call
)
REASONING_FORMAT = think_format(
    "granite",
    lambda model_type, template, vocab: model_type.startswith("granite") and thinks(template, vocab),
    rank=2,
    block=ThinkMarkers(answer_open="<response>", answer_close="</response>"),
)
