"""What a format file declares: ``TOOL_FORMAT`` (a :class:`ToolFormat`) and/or ``REASONING_FORMAT``
(a :class:`ReasoningFormat`), named after the file; the registry, the settings' choices, the
grammar builder and the family probe read nothing else."""

from __future__ import annotations

from collections.abc import Callable, Container
from dataclasses import dataclass

from worker.formats.base import ReasoningStage, ToolCallStream


@dataclass(frozen=True)
class JsonCall:
    """A forced call whose body is JSON: the parts of ``before``, the body, the parts of ``after``.
    With "{name}" in a part the body is the arguments alone, else ``{"name", key}``."""

    before: tuple[str, ...]
    after: tuple[str, ...]
    key: str = "arguments"
    separator: str = ""  # between parallel calls

    @property
    def markers(self) -> tuple[str, ...]:
        """The parts that may be one special token (forced as that token where they are)."""
        return tuple(part for part in self.before + self.after if "{" not in part)


@dataclass(frozen=True)
class TaggedCall:
    """A forced call whose arguments are tagged one by one: ``start`` ("{name}" filled in), then per
    parameter ``key_start`` ("{key}" filled in), the value's JSON, ``key_end``; then ``end``."""

    start: str
    key_start: str
    key_end: str
    end: str
    separator: str  # between parallel calls
    markers: tuple[str, ...] = ()  # the texts inside that may be one special token
    parameter_separator: str = ""  # between two parameters
    every_parameter: bool = False  # optional parameters are written too (no dangling separator)
    around: tuple[str, str] = ("", "")  # around all the calls


CallGrammar = JsonCall | TaggedCall


@dataclass(frozen=True)
class GrammarVariant:
    """A second forced-call form, used when the template (or its rendered call) shows ``marker``."""

    name: str
    marker: str
    grammar: CallGrammar


@dataclass(frozen=True)
class CallProbe:
    """How a call the chat template renders shows the format: all of ``markers`` are in it ("{tool}":
    the probe tool's name). Formats are tried by ``rank``, lowest first (then by name): 0 markers
    only this format writes; 1 a marker other formats' calls write too; 2 the call's shape, which a
    tool listing can show too; 3 a key every tool definition has (the last guess)."""

    markers: tuple[str, ...]
    rank: int = 0


@dataclass(frozen=True)
class ToolFormat:
    """A tool-call format (``--tool-call-parser``, vLLM's name)."""

    name: str
    parser: Callable[[], ToolCallStream]  # a fresh streaming parser for one choice
    grammar: CallGrammar  # a forced call (tool_choice "required" or a named function)
    probe: CallProbe
    # Markers the parser reads: where one is a special token, decoding keeps special tokens.
    markers: tuple[str, ...]
    variant: GrammarVariant | None = None
    stop_tokens: tuple[str, ...] = ()  # tokens that end a turn after a call (besides EOS)
    model_types: tuple[str, ...] = ()  # model types whose template renders no earlier call


# What a reasoning probe sees: the model type, the chat template, the vocabulary.
ThinkingShown = Callable[[str, str, Container[str]], bool]


@dataclass(frozen=True)
class ReasoningFormat:
    """A thinking format (``--reasoning-parser``, vLLM's name)."""

    name: str
    stage: Callable[[bool], ReasoningStage]  # a fresh stage for one choice (the prompt opened the block?)
    open_marker: str  # what a prompt ends with when it opened the thinking block itself ("": none)
    shown: ThinkingShown  # whether a model thinks this way
    rank: int  # probes are tried lowest rank first
    markers: tuple[str, ...] = ()  # as ToolFormat.markers
    stop_tokens: tuple[str, ...] = ()
    # The block as the model writes it: its opening, and the text that ends it, forced when a
    # thinking budget is spent (worker/sampling/thinking_budget.py); ("", ""): no budget applies.
    block: tuple[str, str] = ("", "")
