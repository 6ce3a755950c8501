"""Calls whose arguments are tagged one by one inside ``<tool_call>…</tool_call>``: Qwen3-Coder's
``<function=NAME><parameter=K>v</parameter></function>`` and GLM-4.5's
``NAME<arg_key>k</arg_key><arg_value>v</arg_value>``. A value is JSON when it reads as JSON, else text."""

from __future__ import annotations

import json
import re
from typing import Any

from worker.output.formats.base import CallSyntax, ParsedCall

_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)
_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _call(name: str, pairs: list[tuple[str, str]]) -> ParsedCall:
    arguments = {key.strip(): _value(value) for key, value in pairs}
    return ParsedCall(name.strip(), json.dumps(arguments, ensure_ascii=False))


def parse_qwen3_coder(text: str) -> list[ParsedCall] | None:
    match = _FUNCTION.fullmatch(text)
    if match is None or not match.group(1).strip():
        return None
    pairs = _PARAMETER.findall(match.group(2))
    if _PARAMETER.sub("", match.group(2)).strip():
        return None
    return [_call(match.group(1), pairs)]


def parse_glm45(text: str) -> list[ParsedCall] | None:
    text = text.strip()
    at = text.find("<arg_key>")
    name, rest = (text, "") if at < 0 else (text[:at].strip(), text[at:])
    if not name or "\n" in name or "<" in name:
        return None
    pairs = _GLM_ARG.findall(rest)
    if _GLM_ARG.sub("", rest).strip():
        return None
    return [_call(name, pairs)]


QWEN3_CODER = CallSyntax(start="<tool_call>", end="</tool_call>", parse=parse_qwen3_coder)
GLM45 = CallSyntax(start="<tool_call>", end="</tool_call>", parse=parse_glm45)
