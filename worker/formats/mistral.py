"""Mistral's calls: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}]`` (tokenizer v7 and before) and
``[TOOL_CALLS]NAME[ARGS]{...}`` or ``[TOOL_CALLS]NAME[CALL_ID]id[ARGS]{...}`` (v11, v13), repeated;
its reasoning models think in ``[THINK]``…``[/THINK]``."""

from __future__ import annotations

import json

from worker.formats.base import CallSyntax, ParsedCall, SectionParser, arguments_json, json_call_list
from worker.formats.declaration import CallProbe, GrammarVariant, JsonCall, ToolFormat
from worker.formats.think import ThinkMarkers, think_format

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"


def _named_call(text: str) -> tuple[ParsedCall, str] | None:
    """One ``NAME[ARGS]{...}`` at the start of ``text``; returns it and the rest."""
    head, found, rest = text.partition(ARGS)
    if not found:
        return None
    name = head.split(CALL_ID, 1)[0].strip()
    if not name or not all(part.isidentifier() for part in name.replace("-", "_").split(".")):
        return None
    value, end = json.JSONDecoder().raw_decode(rest.lstrip())
    arguments = arguments_json(value)
    if arguments is None:
        return None
    return ParsedCall(name, arguments), rest.lstrip()[end:]


def parse_mistral(text: str) -> list[ParsedCall] | None:
    if text.lstrip().startswith(("[", "{")):
        return json_call_list(text)
    calls: list[ParsedCall] = []
    rest = text
    while rest.strip():
        rest = rest.lstrip()
        if calls:
            if not rest.startswith(TOOL_CALLS):
                return None
            rest = rest[len(TOOL_CALLS) :]
        found = _named_call(rest)
        if found is None:
            return None
        call, rest = found
        calls.append(call)
    return calls or None


# Each v11+ call opens with [TOOL_CALLS], so one cut short (max_tokens) leaves the earlier ones calls.
MISTRAL = CallSyntax(start=TOOL_CALLS, parse=parse_mistral, repeats=True)

TOOL_FORMAT = ToolFormat(
    name="mistral",
    parser=lambda: SectionParser(MISTRAL),
    grammar=JsonCall((TOOL_CALLS, "["), ("]",)),
    # v11 and later name the call before its arguments.
    variant=GrammarVariant("mistral_v11", ARGS, JsonCall((TOOL_CALLS, "{name}", ARGS), ())),
    probe=CallProbe((TOOL_CALLS,)),
    markers=(TOOL_CALLS, ARGS, CALL_ID),
)
REASONING_FORMAT = think_format(
    "mistral",
    lambda model_type, template, vocab: "[THINK]" in template,
    rank=1,
    block=ThinkMarkers("[THINK]", "[/THINK]"),
    special=True,
)
