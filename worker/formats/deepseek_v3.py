# ruff: noqa: RUF001, RUF002 (DeepSeek's markers have full-width bars and U+2581)
"""DeepSeek V3's (and R1's) calls between ``<｜tool▁calls▁begin｜>`` and ``<｜tool▁calls▁end｜>``:
``function<｜tool▁sep｜>NAME`` and a json code block. The parser also reads V3.1's form
(``NAME<｜tool▁sep｜>{...}``, deepseek_v31.py)."""

from __future__ import annotations

import json

from worker.formats.base import CallSyntax, ParsedCall, SectionParser, arguments_json
from worker.formats.declaration import CallProbe, JsonCall, ToolFormat

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"


def _one(text: str) -> ParsedCall | None:
    head, found, tail = text.partition(SEP)
    if not found:
        return None
    if head.strip() == "function":  # V3 / R1: NAME, then ```json ... ```
        name, _, block = tail.partition("\n")
        body = block.strip().removeprefix("```json").removeprefix("```").removesuffix("```")
    else:  # V3.1
        name, body = head, tail
    arguments = arguments_json(json.loads(body)) if body.strip() else "{}"
    name = name.strip()
    return ParsedCall(name, arguments) if name and arguments is not None else None


def parse_deepseek(text: str) -> list[ParsedCall] | None:
    parts = [p for p in text.split(CALL_BEGIN) if p.strip()]
    calls = []
    for part in parts:
        body, found, after = part.partition(CALL_END)
        if not found or after.strip():
            return None
        call = _one(body)
        if call is None:
            return None
        calls.append(call)
    return calls or None


DEEPSEEK = CallSyntax(start=CALLS_BEGIN, end=CALLS_END, parse=parse_deepseek)
MARKERS = (CALLS_BEGIN, CALL_BEGIN, SEP)

TOOL_FORMAT = ToolFormat(
    name="deepseek_v3",
    parser=lambda: SectionParser(DEEPSEEK),
    grammar=JsonCall(
        (CALLS_BEGIN, CALL_BEGIN, "function", SEP, "{name}\n```json\n"), ("\n```", CALL_END, CALLS_END)
    ),
    probe=CallProbe((CALLS_BEGIN, "function" + SEP)),
    markers=MARKERS,
)
