"""The reasoning stage of the formats that think in a marked block (``<think>``…``</think>``,
Mistral's ``[THINK]``): separates the thinking from the answer. Design notes: docs/worker.md."""

from __future__ import annotations

import enum
from collections.abc import Container
from dataclasses import dataclass

from worker.formats.declaration import ReasoningFormat, ThinkingShown
from worker.formats.markers import split_at_marker

OPEN = "<think>"
CLOSE = "</think>"


class _State(enum.Enum):
    START = 0  # only white space so far: an opening marker may still come
    THINKING = 1
    AFTER_THINKING = 2  # dropping white space before the answer
    CONTENT = 3


@dataclass(frozen=True)
class ThinkMarkers:
    """A format's thinking block; ``answer_open``/``answer_close`` wrap the answer (Granite's
    ``<response>``) and are dropped from the content."""

    open: str = OPEN
    close: str = CLOSE
    answer_open: str = ""
    answer_close: str = ""


def thinks(template: str, vocab: Container[str]) -> bool:
    """Whether a model writes ``<think>`` blocks: its chat template or its vocabulary has the marker."""
    return OPEN in template or OPEN in vocab


class ReasoningParser:
    """One per choice; ``starts_thinking``: the prompt already opened the block."""

    def __init__(self, starts_thinking: bool = False, markers: ThinkMarkers = ThinkMarkers()):
        self._state = _State.THINKING if starts_thinking else _State.START
        self._held = ""
        self._m = markers

    @property
    def in_thinking(self) -> bool:
        return self._state is _State.THINKING

    def push(self, text: str) -> list[tuple[str, str]]:
        buffer, self._held = self._held + text, ""
        out: list[tuple[str, str]] = []
        while buffer:
            if self._state is _State.START:
                stripped = buffer.lstrip()
                if stripped.startswith(self._m.open):
                    self._state, buffer = _State.THINKING, stripped[len(self._m.open) :]
                elif not stripped or self._m.open.startswith(stripped):
                    self._held = buffer  # white space or a partial "<thi": wait for more
                    break
                else:
                    self._state = _State.CONTENT
            elif self._state is _State.THINKING:
                before, found, rest = split_at_marker(buffer, self._m.close)
                out.append(("reasoning", before))
                if not found:
                    self._held = rest
                    break
                self._state, buffer = _State.AFTER_THINKING, rest
            elif self._state is _State.AFTER_THINKING:
                buffer = buffer.lstrip()
                tag = self._m.answer_open
                if tag and buffer and tag.startswith(buffer) and len(buffer) < len(tag):
                    self._held = buffer
                    break
                if tag and buffer.startswith(tag):
                    buffer = buffer[len(tag) :]
                    continue
                if buffer:
                    self._state = _State.CONTENT
            elif self._m.answer_close:
                before, found, rest = split_at_marker(buffer, self._m.answer_close)
                out.append(("content", before))
                if not found:
                    self._held = rest
                    break
                buffer = rest
            else:
                out.append(("content", buffer))
                break
        return _merge(out)

    def finish(self) -> list[tuple[str, str]]:
        """Releases held text at the end (an unfinished marker is just text)."""
        held, self._held = self._held, ""
        kind = "reasoning" if self._state is _State.THINKING else "content"
        return [(kind, held)] if held and self._state is not _State.AFTER_THINKING else []


def _merge(pieces: list[tuple[str, str]]) -> list[tuple[str, str]]:
    merged: list[tuple[str, str]] = []
    for kind, text in pieces:
        if not text:
            continue
        if merged and merged[-1][0] == kind:
            merged[-1] = (kind, merged[-1][1] + text)
        else:
            merged.append((kind, text))
    return merged


def think_format(
    name: str, shown: ThinkingShown, rank: int, block: ThinkMarkers = ThinkMarkers(), special: bool = False
) -> ReasoningFormat:
    """The declaration of a format that thinks in ``block``; ``special``: its markers may be special
    tokens (decoding then keeps them for the parser)."""
    return ReasoningFormat(
        name=name,
        stage=lambda starts_thinking: ReasoningParser(starts_thinking, block),
        open_marker=block.open,
        shown=shown,
        rank=rank,
        markers=(block.open, block.close) if special else (),
        block=(block.open, block.close),
    )
