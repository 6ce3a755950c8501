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
