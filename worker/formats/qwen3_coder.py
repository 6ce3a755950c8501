"""Qwen3-Coder's calls: ``<tool_call><function=NAME><parameter=K>v</parameter></function></tool_call>``."""

from __future__ import annotations

import re

from worker.formats.base import ParsedCall, SectionParser
from worker.formats.declaration import CallProbe, TaggedCall, ToolFormat
from worker.formats.hermes import CLOSE, OPEN
from worker.formats.tagged import tagged_call, tagged_section

_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)


def parse_qwen3_coder(text: str) -> list[ParsedCall] | None:
    match = _FUNCTION.fullmatch(text)
    if match is None or not match.group(1).strip():
        return None
    pairs = _PARAMETER.findall(match.group(2))
    if _PARAMETER.sub("", match.group(2)).strip():
        return None
    return [tagged_call(match.group(1), pairs)]


QWEN3_CODER = tagged_section(parse_qwen3_coder)

TOOL_FORMAT = ToolFormat(
    name="qwen3_coder",
    parser=lambda: SectionParser(QWEN3_CODER),
    grammar=TaggedCall(
        f"{OPEN}\n<function={{name}}>\n",
        "<parameter={key}>\n",
        "\n</parameter>\n",
        f"</function>\n{CLOSE}",
        "\n",
        markers=(OPEN, CLOSE),
    ),
    probe=CallProbe(("<function=",)),
    markers=(OPEN,),
)
