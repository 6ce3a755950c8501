"""GLM-4.5's (and 4.6's) calls, ``<tool_call>NAME<arg_key>k</arg_key><arg_value>v</arg_value></tool_call>``,
and its thinking in ``<think>``…``</think>``."""

from __future__ import annotations

import re

from worker.formats.base import ParsedCall, SectionParser
from worker.formats.declaration import CallProbe, TaggedCall, ToolFormat
from worker.formats.hermes import CLOSE, OPEN
from worker.formats.tagged import tagged_call, tagged_section
from worker.formats.think import think_format, thinks

KEY, KEY_END, VALUE, VALUE_END = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"
_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


def parse_glm45(text: str) -> list[ParsedCall] | None:
    text = text.strip()
    at = text.find(KEY)
    name, rest = (text, "") if at < 0 else (text[:at].strip(), text[at:])
    if not name or "\n" in name or "<" in name:
        return None
    pairs = _ARG.findall(rest)
    if _ARG.sub("", rest).strip():
        return None
    return [tagged_call(name, pairs)]


GLM45 = tagged_section(parse_glm45)

TOOL_FORMAT = ToolFormat(
    name="glm45",
    parser=lambda: SectionParser(GLM45),
    grammar=TaggedCall(
        f"{OPEN}{{name}}\n",
        f"{KEY}{{key}}{KEY_END}\n{VALUE}",
        f"{VALUE_END}\n",
        CLOSE,
        "\n",
        markers=(OPEN, CLOSE, KEY, KEY_END, VALUE, VALUE_END),
    ),
    probe=CallProbe((KEY,)),
    markers=(OPEN, KEY),
)
REASONING_FORMAT = think_format(
    "glm45",
    lambda model_type, template, vocab: model_type.startswith("glm") and thinks(template, vocab),
    rank=2,
)
