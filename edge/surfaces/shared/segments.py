"""The one rule of the block-structured surfaces (Responses, Anthropic, native): a run of
same-kind deltas is one segment (an item, a block); a tool call is one segment per tool index."""

from __future__ import annotations


class Segments:
    """Which segment is open. :meth:`opens` says whether a delta starts a new one (the caller
    closes the open one first, with :meth:`close`, then calls :meth:`begin`)."""

    def __init__(self) -> None:
        self._open: tuple[str, int | None] | None = None

    @property
    def kind(self) -> str | None:
        """The open segment's kind, ``None`` when none is open."""
        return None if self._open is None else self._open[0]

    def opens(self, kind: str, tool_index: int | None = None) -> bool:
        """Whether a delta of ``kind`` (and ``tool_index`` for a tool call) starts a new segment."""
        return self._open != (kind, tool_index)

    def begin(self, kind: str, tool_index: int | None = None) -> None:
        self._open = (kind, tool_index)

    def close(self) -> bool:
        """Closes the open segment; ``False`` when none was open."""
        was_open, self._open = self._open is not None, None
        return was_open
