# ruff: noqa: RUF002 (DeepSeek's markers have full-width bars and U+2581)
"""DeepSeek V3.1's calls: ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`` in V3's
section (read by V3's parser, which knows both forms)."""

from __future__ import annotations

from worker.formats.base import SectionParser
from worker.formats.declaration import CallProbe, JsonCall, ToolFormat
from worker.formats.deepseek_v3 import CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, DEEPSEEK, MARKERS, SEP

TOOL_FORMAT = ToolFormat(
    name="deepseek_v31",
    parser=lambda: SectionParser(DEEPSEEK),
    grammar=JsonCall((CALLS_BEGIN, CALL_BEGIN, "{name}", SEP), (CALL_END, CALLS_END)),
    probe=CallProbe((CALLS_BEGIN,), rank=1),  # V3's calls open the same way: V3's probe goes first
    markers=MARKERS,
)
