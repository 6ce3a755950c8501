"""The parsers by name (vLLM's names): which tool-call stream and which reasoning stage a
request's output goes through."""

from __future__ import annotations

from typing import Protocol

from worker.output.formats.base import CallSyntax, SectionParser, ToolCallStream
from worker.output.formats.deepseek import DEEPSEEK
from worker.output.formats.harmony import HARMONY, HarmonyChannels
from worker.output.formats.json_lists import GRANITE, PHI4_MINI
from worker.output.formats.llama import LlamaCalls
from worker.output.formats.mistral import MISTRAL
from worker.output.formats.pythonic import PYTHONIC
from worker.output.formats.xml_calls import GLM45, QWEN3_CODER
from worker.output.reasoning import ReasoningParser, ThinkMarkers
from worker.output.tool_calls import ToolCallParser


class ReasoningStage(Protocol):
    """Splits text into ("reasoning" | "content", text) pieces; ``in_thinking`` for token counts."""

    @property
    def in_thinking(self) -> bool: ...

    def push(self, text: str) -> list[tuple[str, str]]: ...

    def finish(self) -> list[tuple[str, str]]: ...


_SECTIONS: dict[str, CallSyntax] = {
    "pythonic": PYTHONIC,
    "mistral": MISTRAL,
    "deepseek_v3": DEEPSEEK,
    "deepseek_v31": DEEPSEEK,
    "openai": HARMONY,
    "phi4_mini_json": PHI4_MINI,
    "granite": GRANITE,
    "glm45": GLM45,
    "qwen3_coder": QWEN3_CODER,
}
TOOL_PARSERS = ("hermes", "llama3_json", *_SECTIONS)

THINK = ThinkMarkers()
_MARKERS: dict[str, ThinkMarkers] = {
    "qwen3": THINK,
    "deepseek_r1": THINK,
    "glm45": THINK,
    "granite": ThinkMarkers(answer_open="<response>", answer_close="</response>"),
    "mistral": ThinkMarkers("[THINK]", "[/THINK]"),
}
REASONING_PARSERS = (*_MARKERS, "openai_gptoss")


def tool_call_stream(name: str) -> ToolCallStream:
    """A fresh parser for one choice; unknown names get today's parser (hermes blocks, bare JSON)."""
    if name == "llama3_json":
        return LlamaCalls()
    syntax = _SECTIONS.get(name)
    return SectionParser(syntax) if syntax is not None else ToolCallParser()


def reasoning_stage(name: str, starts_thinking: bool) -> ReasoningStage:
    if name == "openai_gptoss":
        return HarmonyChannels()
    return ReasoningParser(starts_thinking, _MARKERS.get(name, THINK))


def thinking_open_marker(name: str) -> str:
    """The marker a prompt ends with when it opened the thinking block itself ("" for harmony)."""
    return "" if name == "openai_gptoss" else _MARKERS.get(name, THINK).open
