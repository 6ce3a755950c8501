"""gpt-oss's calls (``openai``): a harmony message to ``functions.NAME`` whose body is the arguments,
``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>``."""

from __future__ import annotations

from worker.formats.base import CallSyntax, ParsedCall, SectionParser, arguments_json
from worker.formats.declaration import CallProbe, JsonCall, ToolFormat
from worker.formats.openai_gptoss import CALL, CHANNEL, MESSAGE, RECIPIENT, START


def parse_harmony_call(text: str) -> list[ParsedCall] | None:
    header, found, body = text.partition(MESSAGE)
    match = RECIPIENT.search(header)
    if not found or match is None:
        return None
    arguments = arguments_json(body.strip() or "{}")
    return [ParsedCall(match.group(1), arguments)] if arguments is not None else None


HARMONY = CallSyntax(start=CHANNEL, end=CALL, parse=parse_harmony_call)

TOOL_FORMAT = ToolFormat(
    name="openai",
    parser=lambda: SectionParser(HARMONY),
    grammar=JsonCall((CHANNEL, "commentary to=functions.{name} ", "<|constrain|>", "json", MESSAGE), (CALL,)),
    probe=CallProbe(("to=functions.",)),
    markers=(CHANNEL, MESSAGE, "<|end|>", START),
    stop_tokens=(CALL,),
)
