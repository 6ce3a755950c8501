"""Gemma 4's calls, ``<|tool_call>call:NAME{key:value,...}<tool_call|>`` one per call, whose values are
written in its own notation (strings between ``<|"|>`` marks, keys bare), and its thinking in a
``<|channel>thought`` … ``<channel|>`` block."""

from __future__ import annotations

import json
from typing import Any

from worker.formats.base import CallSyntax, ParsedCall, SectionParser
from worker.formats.declaration import CallProbe, TaggedCall, ToolFormat
from worker.formats.think import ThinkMarkers, think_format

OPEN, CLOSE = "<|tool_call>", "<tool_call|>"
QUOTE = '<|"|>'
RESPONSE = "<|tool_response>"  # the template follows a call with the tool's answer: a call ends the turn
THOUGHT = ThinkMarkers(open="<|channel>thought\n", close="<channel|>")
_LITERALS = {"true": True, "false": False, "null": None, "None": None}


class _Reader:
    """A recursive reader of one value of Gemma's notation (JSON's strings accepted too, which a
    forced call writes); raises ValueError on anything else."""

    def __init__(self, text: str):
        self.text = text
        self.at = 0

    def value(self) -> Any:
        self._space()
        text, at = self.text, self.at
        if text.startswith(QUOTE, at):
            end = text.find(QUOTE, at + len(QUOTE))
            if end < 0:
                raise ValueError("an unclosed string")
            self.at = end + len(QUOTE)
            return text[at + len(QUOTE) : end]
        if text.startswith('"', at):
            value, self.at = json.JSONDecoder().raw_decode(text, at)
            return value
        if text.startswith("{", at):
            return dict(self._items("{", "}", keyed=True))
        if text.startswith("[", at):
            return [item for _, item in self._items("[", "]", keyed=False)]
        return self._literal()

    def _items(self, open_: str, close: str, *, keyed: bool) -> list[tuple[str, Any]]:
        self.at += len(open_)
        items: list[tuple[str, Any]] = []
        while True:
            self._space()
            if self.text.startswith(close, self.at) and not items:
                self.at += 1
                return items
            key = self._key() if keyed else ""
            items.append((key, self.value()))
            self._space()
            if self.text.startswith(",", self.at):
                self.at += 1
            elif self.text.startswith(close, self.at):
                self.at += 1
                return items
            else:
                raise ValueError(f"expected ',' or {close!r}")

    def _key(self) -> str:
        if self.text.startswith((QUOTE, '"'), self.at):
            key = self.value()
        else:
            end = self.text.find(":", self.at)
            key = self.text[self.at : end].strip() if end >= 0 else ""
            if not key or any(c in key for c in "{}[],<>\"'\n"):
                raise ValueError("a bad key")
            self.at = end
        self._space()
        if not isinstance(key, str) or not self.text.startswith(":", self.at):
            raise ValueError("expected ':' after a key")
        self.at += 1
        return key

    def _literal(self) -> Any:
        end = self.at
        while end < len(self.text) and self.text[end] not in ",}]":
            end += 1
        word = self.text[self.at : end].strip()
        self.at = end
        if word in _LITERALS:
            return _LITERALS[word]
        try:
            return json.loads(word)  # a number
        except json.JSONDecodeError:
            raise ValueError(f"not a value: {word!r}") from None

    def _space(self) -> None:
        while self.at < len(self.text) and self.text[self.at].isspace():
            self.at += 1

    def done(self) -> bool:
        self._space()
        return self.at == len(self.text)


def parse_gemma4(text: str) -> list[ParsedCall] | None:
    """One call's body, ``call:NAME{...}``; None when it is not one."""
    body = text.strip()
    brace = body.find("{")
    name = body[len("call:") : brace].strip() if body.startswith("call:") and brace > 0 else ""
    if not name or not all(part.replace("-", "_").isidentifier() for part in name.split(".")):
        return None
    reader = _Reader(body[brace:])
    try:
        arguments = reader.value()
    except ValueError:
        return None
    if not isinstance(arguments, dict) or not reader.done():
        return None
    return [ParsedCall(name, json.dumps(arguments, ensure_ascii=False))]


GEMMA4 = CallSyntax(start=OPEN, end=CLOSE, parse=parse_gemma4)

TOOL_FORMAT = ToolFormat(
    name="gemma4",
    parser=lambda: SectionParser(GEMMA4),
    # Values are forced as JSON (which the parser reads too); every parameter is written, so no
    # separator is left dangling.
    grammar=TaggedCall(
        OPEN + "call:{name}{",
        "{key}:",
        "",
        "}" + CLOSE,
        "",
        markers=(OPEN, CLOSE),
        parameter_separator=",",
        every_parameter=True,
    ),
    probe=CallProbe((OPEN + "call:{tool}",)),
    markers=(OPEN, CLOSE),
    stop_tokens=(RESPONSE,),
)
REASONING_FORMAT = think_format(
    "gemma4",
    lambda model_type, template, vocab: "<|channel>" in template or "<|channel>" in vocab,
    rank=0,
    block=THOUGHT,
    special=True,
)
