"""LFM2's calls: a pythonic list between ``<|tool_call_start|>`` and ``<|tool_call_end|>``
(``<|tool_call_start|>[get_weather(city="Paris")]<|tool_call_end|>``). Its chat template renders no
earlier call, so the format is chosen by model type."""

from __future__ import annotations

from worker.formats.base import CallSyntax, SectionParser
from worker.formats.declaration import CallProbe, TaggedCall, ToolFormat
from worker.formats.pythonic import parse_pythonic

OPEN, CLOSE = "<|tool_call_start|>", "<|tool_call_end|>"
LFM2 = CallSyntax(start=OPEN, end=CLOSE, parse=parse_pythonic)

TOOL_FORMAT = ToolFormat(
    name="lfm2",
    parser=lambda: SectionParser(LFM2),
    # Python's argument list: every parameter given, so no separator is left dangling.
    grammar=TaggedCall(
        "{name}(",
        "{key}=",
        "",
        ")",
        ", ",
        markers=(OPEN, CLOSE),
        parameter_separator=", ",
        every_parameter=True,
        around=(OPEN + "[", "]" + CLOSE),
    ),
    probe=CallProbe((OPEN,)),
    markers=(OPEN, CLOSE),
    model_types=("lfm2", "lfm2_vl"),
)
