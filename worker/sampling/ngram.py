"""Prompt-lookup (n-gram) proposals: the tokens that followed the latest earlier occurrence of a
sequence's own suffix, for the engine to verify in one forward (docs/worker.md)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def propose(tokens: Sequence[int], *, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to ``k`` tokens following the latest earlier occurrence of the longest suffix of ``tokens``
    of ``min_n``..``max_n`` tokens (longest first, latest among equals); [] when none occurred."""
    length = len(tokens)
    if k <= 0 or length < min_n + 1:
        return []
    ids = np.asarray(tokens, dtype=np.int64)
    # Every earlier position holding the last token is a candidate end of a match.
    ends = np.flatnonzero(ids[:-1] == ids[-1])
    if ends.size == 0:
        return []
    best_end, best_n = -1, 0
    for end in ends[::-1].tolist():  # latest first: an equal length later never wins
        n = 1
        while n < max_n and end - n >= 0 and ids[end - n] == ids[length - 1 - n]:
            n += 1
        if n > best_n:
            best_end, best_n = end, n
            if n == max_n:
                break
    if best_n < min_n:
        return []
    return ids[best_end + 1 : best_end + 1 + k].tolist()
