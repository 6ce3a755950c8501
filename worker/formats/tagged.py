"""What the formats that tag arguments one by one inside ``<tool_call>…</tool_call>`` share (Qwen3-Coder,
GLM-4.5): their section, and a call from its (key, value) texts, a value JSON when it reads as JSON."""

from __future__ import annotations

import json
from typing import Any

from worker.formats.base import CallSyntax, Parse, ParsedCall
from worker.formats.hermes import CLOSE, OPEN


def tagged_section(parse: Parse) -> CallSyntax:
    """The ``<tool_call>…</tool_call>`` section whose body ``parse`` reads."""
    return CallSyntax(start=OPEN, end=CLOSE, parse=parse)


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def tagged_call(name: str, pairs: list[tuple[str, str]]) -> ParsedCall:
    """The call to ``name`` with the (key, value text) pairs as its arguments."""
    arguments = {key.strip(): _value(value) for key, value in pairs}
    return ParsedCall(name.strip(), json.dumps(arguments, ensure_ascii=False))
