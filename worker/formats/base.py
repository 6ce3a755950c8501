# ruff: noqa: RUF002 (DeepSeek's markers have full-width bars and U+2581)
"""What every format's parser speaks (pieces, the tool-call and reasoning protocols), and the
streaming parser for calls in a marked section (``[TOOL_CALLS]…``, ``<｜tool▁calls▁begin｜>…``):
held until complete, then parsed whole, so the result never depends on how the text was split."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from sluice.ids import new_tool_call_id
from worker.formats.markers import split_at_marker


@dataclass(frozen=True)
class ContentPiece:
    text: str


@dataclass(frozen=True)
class CallPiece:
    tool_index: int
    arguments: str
    call_id: str = ""
    name: str = ""


Piece = ContentPiece | CallPiece


def merge_pieces(pieces: list[Piece]) -> list[Piece]:
    """Joins neighbouring content pieces and drops empty ones."""
    merged: list[Piece] = []
    for piece in pieces:
        if isinstance(piece, ContentPiece):
            if not piece.text:
                continue
            if merged and isinstance(merged[-1], ContentPiece):
                merged[-1] = ContentPiece(merged[-1].text + piece.text)
                continue
        merged.append(piece)
    return merged


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text of an object


class ToolCallStream(Protocol):
    """One per choice: ``push`` text, then ``finish`` once; ``calls`` counts the calls so far."""

    calls: int

    def push(self, text: str) -> list[Piece]: ...

    def finish(self) -> list[Piece]: ...


class ReasoningStage(Protocol):
    """Splits text into ("reasoning" | "content", text) pieces; ``in_thinking`` for token counts."""

    @property
    def in_thinking(self) -> bool: ...

    def push(self, text: str) -> list[tuple[str, str]]: ...

    def finish(self) -> list[tuple[str, str]]: ...


Parse = Callable[[str], list[ParsedCall] | None]


@dataclass(frozen=True)
class CallSyntax:
    """Where a format's calls sit: ``start`` opens a section, ``end`` closes it ("": the section
    runs to the end of the text); ``parse`` reads a whole section (None: malformed, kept as text)."""

    start: str
    parse: Parse
    end: str = ""
    at_start: bool = False  # a section counts only at the start of the answer
    start_in_body: bool = False  # the start marker is part of what ``parse`` reads (``[`` of a list)
    repeats: bool = False  # each call opens with ``start``: the next ``start`` ends a section


class SectionParser:
    """A :class:`ToolCallStream` for a :class:`CallSyntax`."""

    def __init__(self, syntax: CallSyntax, id_factory: Callable[[], str] = new_tool_call_id):
        self._syntax = syntax
        self._new_id = id_factory
        self._held = ""
        self._body: str | None = None  # inside a section: its text so far
        self._only_space = True
        self.calls = 0

    def push(self, text: str) -> list[Piece]:
        out: list[Piece] = []
        buffer, self._held = self._held + text, ""
        while buffer:
            buffer = self._text(buffer, out) if self._body is None else self._section(buffer, out)
        return merge_pieces(out)

    def finish(self) -> list[Piece]:
        out: list[Piece] = []
        if self._body is not None:
            self._close(self._body, out)
        elif self._held and (self._held.strip() or not self.calls):
            out.append(ContentPiece(self._held))
        self._held, self._body = "", None
        return merge_pieces(out)

    def _text(self, buffer: str, out: list[Piece]) -> str:
        start = self._syntax.start
        if self._syntax.at_start:
            if not self._only_space:
                out.append(ContentPiece(buffer))
                return ""
            stripped = buffer.lstrip()
            if not stripped or (start.startswith(stripped) and len(stripped) < len(start)):
                self._held = buffer
                return ""
            if not stripped.startswith(start):
                self._only_space = False
                out.append(ContentPiece(buffer))
                return ""
            before, found, rest = "", True, stripped[len(start) :]
        else:
            before, found, rest = split_at_marker(buffer, start)
        if self.calls and not before.strip():
            # White space between or after calls is layout: hold it until text follows.
            if not found:
                self._held = before + rest
                return ""
            before = ""
        if before.strip():
            self._only_space = False
        out.append(ContentPiece(before))
        if not found:
            self._held = rest
            return ""
        self._body = start if self._syntax.start_in_body else ""
        return rest

    def _section(self, buffer: str, out: list[Piece]) -> str:
        assert self._body is not None
        end = self._syntax.end
        body = self._body + buffer
        if self._syntax.repeats and (at := body.find(self._syntax.start)) >= 0:
            # The next call: this one is complete (or cut short, then it stays text).
            self._body = None
            self._close(body[:at], out)
            return body[at:]
        at = body.find(end) if end else -1
        if at < 0:
            self._body = body
            return ""
        self._body = None
        self._close(body[:at], out, closed=True)
        return body[at + len(end) :]

    def _close(self, body: str, out: list[Piece], closed: bool = False) -> None:
        calls = _safe_parse(self._syntax.parse, body)
        if not calls:
            prefix = "" if self._syntax.start_in_body else self._syntax.start
            out.append(ContentPiece(prefix + body + (self._syntax.end if closed else "")))
            self._only_space = False
            return
        for call in calls:
            out.append(CallPiece(self.calls, "", self._new_id(), call.name))
            out.append(CallPiece(self.calls, call.arguments))
            self.calls += 1


def _safe_parse(parse: Parse, body: str) -> list[ParsedCall] | None:
    """Model text is untrusted: a parser bug on odd text must give content, never an exception."""
    try:
        return parse(body)
    except (ValueError, TypeError, KeyError, IndexError, RecursionError, SyntaxError):
        return None


def arguments_json(value: Any) -> str | None:
    """Arguments as JSON object text: a mapping, or a string holding one (None otherwise)."""
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except json.JSONDecodeError:
            return None
    if value is None:
        value = {}
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


def json_call(item: Any) -> ParsedCall | None:
    """``{"name": ..., "arguments"|"parameters": {...}}`` as a call (None when it is not one)."""
    if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
        return None
    arguments = arguments_json(item.get("arguments", item.get("parameters")))
    return ParsedCall(item["name"], arguments) if arguments is not None else None


def json_call_list(text: str) -> list[ParsedCall] | None:
    """A JSON list of calls (or one call object), with nothing but white space after it."""
    value, end = json.JSONDecoder().raw_decode(text.strip())
    if text.strip()[end:].strip():
        return None
    items = value if isinstance(value, list) else [value]
    calls = [json_call(item) for item in items]
    return [c for c in calls if c is not None] if calls and all(calls) else None
