"""The formats by name (vLLM's names), gathered from the format files of this package: every module
that declares ``TOOL_FORMAT`` or ``REASONING_FORMAT``. Adding a format is adding its file."""

from __future__ import annotations

import importlib
import pkgutil

from worker.formats.base import ReasoningStage, ToolCallStream
from worker.formats.declaration import CallGrammar, ReasoningFormat, ToolFormat


def _declared() -> tuple[dict[str, ToolFormat], dict[str, ReasoningFormat]]:
    """Every format file's declarations, by name, in file-name order."""
    tools: dict[str, ToolFormat] = {}
    reasoning: dict[str, ReasoningFormat] = {}
    package = __name__.rpartition(".")[0]
    found = pkgutil.iter_modules(importlib.import_module(package).__path__, package + ".")
    for name in sorted(m.name for m in found if m.name != __name__):
        module = importlib.import_module(name)
        if isinstance(tool := getattr(module, "TOOL_FORMAT", None), ToolFormat):
            tools[tool.name] = tool
        if isinstance(thinking := getattr(module, "REASONING_FORMAT", None), ReasoningFormat):
            reasoning[thinking.name] = thinking
    return tools, reasoning


TOOL_FORMATS, REASONING_FORMATS = _declared()
TOOL_PARSERS = tuple(TOOL_FORMATS)
REASONING_PARSERS = tuple(REASONING_FORMATS)
DEFAULT_TOOLS = TOOL_FORMATS["hermes"]  # what an unknown name gets: hermes blocks, bare JSON
DEFAULT_REASONING = REASONING_FORMATS["qwen3"]  # a <think> block

# The forced-call grammars by name: each format's, and its variant's.
CALL_GRAMMARS: dict[str, CallGrammar] = {
    **{name: tool.grammar for name, tool in TOOL_FORMATS.items()},
    **{tool.variant.name: tool.variant.grammar for tool in TOOL_FORMATS.values() if tool.variant},
}


def tool_call_stream(name: str) -> ToolCallStream:
    """A fresh parser for one choice."""
    return TOOL_FORMATS.get(name, DEFAULT_TOOLS).parser()


def reasoning_stage(name: str, starts_thinking: bool) -> ReasoningStage:
    return REASONING_FORMATS.get(name, DEFAULT_REASONING).stage(starts_thinking)


def thinking_open_marker(name: str) -> str:
    """The marker a prompt ends with when it opened the thinking block itself ("" for harmony)."""
    return REASONING_FORMATS.get(name, DEFAULT_REASONING).open_marker


def thinking_block(name: str) -> tuple[str, str]:
    """A thinking format's block as the model writes it: its opening and the text that ends it."""
    return REASONING_FORMATS.get(name, DEFAULT_REASONING).block


def call_grammar(name: str) -> CallGrammar:
    """The forced-call grammar of a format (or variant) name; hermes's for an unknown name."""
    return CALL_GRAMMARS.get(name, DEFAULT_TOOLS.grammar)
