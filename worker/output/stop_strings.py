"""Stop-string matching over a stream of text deltas, without leaking a stop string.

Text that could still turn out to be the start of a stop string is held back
until the next delta decides it; a stop string spanning several tokens is
therefore caught and never emitted, not even in part.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence


class StopStringMatcher:
    """One instance per sequence. ``push`` returns (text to emit, matched stop or None); a matched
    stop in ``kept`` ends the emitted text (``include_stop_str_in_output``), any other is dropped."""

    def __init__(self, stops: Sequence[str], kept: Collection[str] = ()):
        self._stops = tuple(s for s in stops if s)
        self._kept = frozenset(kept)
        self._pending = ""

    def push(self, text: str) -> tuple[str, str | None]:
        if not self._stops:
            return text, None
        buffer = self._pending + text
        match_at, matched = -1, None
        for stop in self._stops:
            at = buffer.find(stop)
            if at >= 0 and (match_at < 0 or at < match_at):
                match_at, matched = at, stop
        if matched is not None:
            self._pending = ""
            end = match_at + len(matched) if matched in self._kept else match_at
            return buffer[:end], matched
        hold = self._longest_stop_prefix_suffix(buffer)
        self._pending = buffer[len(buffer) - hold :] if hold else ""
        return buffer[: len(buffer) - hold], None

    def flush(self) -> str:
        """Releases held text when the sequence ends for another reason."""
        text, self._pending = self._pending, ""
        return text

    def _longest_stop_prefix_suffix(self, buffer: str) -> int:
        best = 0
        for stop in self._stops:
            for size in range(min(len(stop) - 1, len(buffer)), best, -1):
                if buffer.endswith(stop[:size]):
                    best = size
                    break
        return best
