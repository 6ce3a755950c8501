"""A choice's generated text → content, reasoning and tool-call events.

Design notes: docs/worker.md.
"""

from __future__ import annotations

from dataclasses import replace

from worker.formats.base import CallPiece, Piece
from worker.formats.registry import reasoning_stage, tool_call_stream
from worker.types import ContentDelta, OutputOptions, ReasoningDelta, TokenLogprob, ToolCallDelta

OutputEvent = ContentDelta | ReasoningDelta | ToolCallDelta


class ChoiceOutput:
    """One per choice. Call order: ``add_token`` per generated token, ``push`` for each piece of text the
    detokenizer and stop matcher release, ``finish`` once at the end."""

    def __init__(self, choice_index: int, options: OutputOptions):
        self.index = choice_index
        self.options = options
        self._reasoning = (
            reasoning_stage(options.reasoning_parser, options.starts_thinking) if options.reasoning else None
        )
        self._tools = tool_call_stream(options.tool_parser) if options.tool_calls else None
        self._ids: list[int] = []
        self._logprobs: list[TokenLogprob] = []

    @property
    def tool_calls(self) -> int:
        return self._tools.calls if self._tools is not None else 0

    @property
    def holds_token_ids(self) -> bool:
        """Tokens were added whose ids no delta carried yet (their text is held back)."""
        return bool(self._ids)

    @property
    def thinking(self) -> bool:
        """Whether the text so far ended inside the thinking block (for counting reasoning tokens)."""
        return self._reasoning is not None and self._reasoning.in_thinking

    def add_token(self, token_id: int | None, logprob: TokenLogprob | None) -> None:
        """Records a generated token (its id only when the caller asked for ids)."""
        if token_id is not None:
            self._ids.append(token_id)
        if logprob is not None:
            self._logprobs.append(logprob)

    def push(self, text: str) -> list[OutputEvent]:
        if not text:
            return []
        pieces = self._reasoning.push(text) if self._reasoning is not None else [("content", text)]
        return self._attach(self._events(pieces), final=False)

    def finish(self, text: str) -> list[OutputEvent]:
        pieces = self._reasoning.push(text) if self._reasoning is not None and text else []
        if self._reasoning is not None:
            pieces += self._reasoning.finish()
        elif text:
            pieces = [("content", text)]
        events = self._events(pieces)
        if self._tools is not None:
            events += [self._convert(piece) for piece in self._tools.finish()]
        return self._attach(events, final=True)

    def _events(self, pieces: list[tuple[str, str]]) -> list[OutputEvent]:
        events: list[OutputEvent] = []
        for kind, text in pieces:
            if kind == "reasoning":
                if self.options.keep_reasoning:
                    events.append(ReasoningDelta(self.index, text))
            elif self._tools is None:
                events.append(ContentDelta(self.index, text))
            else:
                events += [self._convert(piece) for piece in self._tools.push(text)]
        return events

    def _convert(self, piece: Piece) -> OutputEvent:
        if isinstance(piece, CallPiece):
            return ToolCallDelta(self.index, piece.tool_index, piece.arguments, piece.call_id, piece.name)
        return ContentDelta(self.index, piece.text)

    def _attach(self, events: list[OutputEvent], final: bool) -> list[OutputEvent]:
        """Puts the pending tokens' logprobs on the first content or reasoning delta (dropped for tokens
        that only made tool calls) and their ids on the LAST delta (content, reasoning or tool call);
        keeps both while the parsers hold text back. Ids go last so that a caller who received a delta
        with ids has received every delta those tokens produced: what a migrated stream resumes from
        (see ``Resume`` in the proto)."""
        if not self._ids and not self._logprobs:
            return events
        ids, logprobs = tuple(self._ids), tuple(self._logprobs)
        if not events:
            if final:
                # Tokens that produced no text at the end (a special token, an unfinished character).
                self._ids, self._logprobs = [], []
                return [ContentDelta(self.index, "", ids, logprobs)]
            return events
        if logprobs:
            first_text = next(
                (i for i, e in enumerate(events) if isinstance(e, ContentDelta | ReasoningDelta)), None
            )
            if first_text is not None:
                event = events[first_text]
                assert isinstance(event, ContentDelta | ReasoningDelta)
                events[first_text] = type(event)(event.choice_index, event.text, event.token_ids, logprobs)
            self._logprobs = []
        if ids:
            last = len(events) - 1
            tail = events[last]
            events[last] = (  # built directly in the common case: replace() costs ten times more
                ContentDelta(tail.choice_index, tail.text, ids, tail.logprobs)
                if type(tail) is ContentDelta
                else replace(tail, token_ids=ids)
            )
            self._ids = []
        return events
