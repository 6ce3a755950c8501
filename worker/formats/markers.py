"""Finding a marker (such as ``<think>``) in streamed text without splitting it."""

from __future__ import annotations


def split_at_marker(buffer: str, marker: str) -> tuple[str, bool, str]:
    """Splits ``buffer`` at the first ``marker``.

    Returns (text before, found, rest). When the marker is not found, "rest"
    is the longest tail of ``buffer`` that could still be the start of the
    marker (to be held back until more text arrives), and "text before" is
    everything else.
    """
    at = buffer.find(marker)
    if at >= 0:
        return buffer[:at], True, buffer[at + len(marker) :]
    for size in range(min(len(marker) - 1, len(buffer)), 0, -1):
        if buffer.endswith(marker[:size]):
            return buffer[:-size], False, buffer[-size:]
    return buffer, False, ""


def split_at_first(buffer: str, markers: tuple[str, ...]) -> tuple[str, str | None, str]:
    """Splits ``buffer`` at the earliest of ``markers``: (text before, the marker or None, rest).

    With no marker found, "rest" is the longest tail that could start one (held back)."""
    found = [(buffer.find(m), m) for m in markers if m in buffer]
    if found:
        at, marker = min(found)
        return buffer[:at], marker, buffer[at + len(marker) :]
    hold = max((len(split_at_marker(buffer, m)[2]) for m in markers), default=0)
    return (buffer[:-hold], None, buffer[-hold:]) if hold else (buffer, None, "")
