"""Mistral's calls: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}]`` (tokenizer v7 and before) and
``[TOOL_CALLS]NAME[ARGS]{...}`` or ``[TOOL_CALLS]NAME[CALL_ID]id[ARGS]{...}`` (v11, v13), repeated."""

from __future__ import annotations

import json

from worker.output.formats.base import CallSyntax, ParsedCall, arguments_json, json_call_list

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
