"""Each format file of worker/formats/ declares everything about its format, and what the settings,
the grammar builder and the family probe know of formats is what those files declare."""

from __future__ import annotations

import importlib
import json
import pkgutil
from typing import Any

import pytest

import worker.formats
from sluice.settings import settings_of
from worker.config import ENV_PREFIX, WorkerConfig
from worker.formats.base import CallPiece, ContentPiece
from worker.formats.declaration import CallGrammar, JsonCall, ReasoningFormat, TaggedCall, ToolFormat
from worker.formats.registry import REASONING_FORMATS, TOOL_FORMATS, call_grammar
from worker.prompts.family import PROBE_TOOL, _call_format
from worker.sampling.grammar import call_markers

# The modules that are shared by formats rather than formats themselves.
HELPERS = {"base", "declaration", "markers", "registry", "tagged", "think"}
MODULES = sorted(m.name for m in pkgutil.iter_modules(worker.formats.__path__))
ARGUMENTS = {"arg": "sluice value", "n": 2}


def declarations(name: str) -> list[ToolFormat | ReasoningFormat]:
    module = importlib.import_module(f"worker.formats.{name}")
    found = [getattr(module, attribute, None) for attribute in ("TOOL_FORMAT", "REASONING_FORMAT")]
    return [d for d in found if d is not None]


@pytest.mark.parametrize("module", MODULES)
def test_every_format_file_declares_formats_named_after_it(module: str) -> None:
    declared = declarations(module)
    if module in HELPERS:
        assert not declared, f"{module}.py declares a format but is listed as a helper"
        return
    assert declared, f"worker/formats/{module}.py declares neither TOOL_FORMAT nor REASONING_FORMAT"
    for declaration in declared:
        assert isinstance(declaration, ToolFormat | ReasoningFormat)
        assert declaration.name == module, f"{module}.py declares {declaration.name!r}: name it as its file"


def test_the_registry_and_the_settings_offer_exactly_the_declared_formats() -> None:
    tools = {d.name for m in MODULES for d in declarations(m) if isinstance(d, ToolFormat)}
    thinking = {d.name for m in MODULES for d in declarations(m) if isinstance(d, ReasoningFormat)}
    assert set(TOOL_FORMATS) == tools and set(REASONING_FORMATS) == thinking
    specs = {s.name: s.spec for s in settings_of(WorkerConfig, ENV_PREFIX)}
    for setting, names in (("tool_call_parser", tools), ("reasoning_parser", thinking)):
        for name in ("auto", "none", *names):
            assert specs[setting].parse(name) == name
        with pytest.raises(ValueError, match="must be one of"):
            specs[setting].parse("no_such_format")


def write_call(grammar: CallGrammar, name: str, arguments: dict[str, Any]) -> str:
    """One call as the grammar forces it (each value written as its JSON)."""
    if isinstance(grammar, JsonCall):
        named = any("{name}" in part for part in grammar.before)
        body = arguments if named else {"name": name, grammar.key: arguments}
        before = "".join(part.replace("{name}", name) for part in grammar.before)
        return before + json.dumps(body) + "".join(grammar.after)
    parameters = [
        grammar.key_start.replace("{key}", key) + json.dumps(value) + grammar.key_end
        for key, value in arguments.items()
    ]
    call = grammar.start.replace("{name}", name) + grammar.parameter_separator.join(parameters) + grammar.end
    return grammar.around[0] + call + grammar.around[1]


def parse(tool: ToolFormat, text: str) -> tuple[str, list[tuple[str, dict[str, Any]]]]:
    parser = tool.parser()
    pieces = [*parser.push(text), *parser.finish()]
    content = "".join(p.text for p in pieces if isinstance(p, ContentPiece))
    calls: dict[int, list[str]] = {}
    for piece in pieces:
        if isinstance(piece, CallPiece):
            entry = calls.setdefault(piece.tool_index, ["", ""])
            entry[0] += piece.name
            entry[1] += piece.arguments
    return content, [(call_name, json.loads(args)) for call_name, args in calls.values()]


@pytest.mark.parametrize("name", sorted(TOOL_FORMATS))
def test_each_tool_formats_parser_reads_its_forced_call(name: str) -> None:
    tool = TOOL_FORMATS[name]
    assert tool.parser() is not tool.parser(), "a fresh parser per choice"
    grammars = [tool.grammar] + ([tool.variant.grammar] if tool.variant else [])
    for grammar in grammars:
        assert parse(tool, write_call(grammar, PROBE_TOOL, ARGUMENTS)) == ("", [(PROBE_TOOL, ARGUMENTS)])


@pytest.mark.parametrize("name", sorted(TOOL_FORMATS))
def test_the_probe_finds_each_tool_format_in_its_own_call(name: str) -> None:
    tool = TOOL_FORMATS[name]
    written = write_call(tool.grammar, PROBE_TOOL, ARGUMENTS)
    assert tool.probe.markers
    assert all(marker.replace("{tool}", PROBE_TOOL) in written for marker in tool.probe.markers)
    assert _call_format(written) == name


def test_the_grammar_builder_reads_the_declared_grammars() -> None:
    for tool in TOOL_FORMATS.values():
        forms = [(tool.name, tool.grammar)] + (
            [(tool.variant.name, tool.variant.grammar)] if tool.variant else []
        )
        for name, grammar in forms:
            assert call_grammar(name) is grammar
            assert set(grammar.markers) <= call_markers()
            if isinstance(grammar, TaggedCall):  # its special-token candidates are in its texts
                assert all(
                    m
                    in grammar.start
                    + grammar.key_start
                    + grammar.key_end
                    + grammar.end
                    + "".join(grammar.around)
                    for m in grammar.markers
                )
    assert call_grammar("no_such_format") is TOOL_FORMATS["hermes"].grammar


@pytest.mark.parametrize("name", sorted(REASONING_FORMATS))
def test_each_reasoning_format_declares_a_fresh_stage(name: str) -> None:
    thinking = REASONING_FORMATS[name]
    stage = thinking.stage(False)
    assert stage is not thinking.stage(False)
    assert stage.push("Hello") + stage.finish() == [("content", "Hello")]
    assert not thinking.open_marker or thinking.stage(True).in_thinking


def test_markers_around_tagged_calls_are_forced_as_their_special_token() -> None:
    """LFM2's ``<|tool_call_start|>`` and ``<|tool_call_end|>`` wrap all its calls (``around``): where
    they are one token, the forced call's grammar names that token, as for the other parts."""
    from worker.sampling.grammar import GrammarSpec, _tagged_lark

    grammar = call_grammar("lfm2")
    assert isinstance(grammar, TaggedCall)
    spec = GrammarSpec(
        "tool_call", functions=(("f", {"type": "object", "properties": {}}),), call_format="lfm2"
    )
    lark = _tagged_lark(spec, grammar, {"<|tool_call_start|>": 5, "<|tool_call_end|>": 6})
    assert lark.startswith('start: <[5]> "[" call ') and '"]" <[6]>' in lark
    assert "<|tool_call_start|>" not in lark
