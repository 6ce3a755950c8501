"""Speculative verification: how many of each row's proposals its own draws accept, each draw made
as a one-token step would make it (for a point-mass proposal, speculative sampling's rejection rule).

Design notes: docs/worker.md ("Speculative decoding").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

# Draws one token for each of the given rows from their logits rows; returns, per row, the tokens
# it drew (none if the draw failed it) and whether it may go on (not ended, not failed).
RowDraw = Callable[[list[int], torch.Tensor], list[tuple[list[int], bool]]]


def accepted(
    logits: torch.Tensor, firsts: Sequence[int], proposals: Sequence[Sequence[int]], draw: RowDraw
) -> list[int]:
    """Each row's accepted proposals. Row ``r``'s logits for its output positions are
    ``logits[firsts[r] + position]``; position by position every row still going draws once
    (``draw``): a draw equal to the row's proposal at that position accepts it and the row draws
    again at the next position, any other draw (or an end) ends the row's verification."""
    kept = [0] * len(proposals)
    live = list(range(len(proposals)))
    position = 0
    while live:
        index = torch.tensor([firsts[row] + position for row in live], device=logits.device)
        going = []
        for row, (drawn, goes_on) in zip(live, draw(live, logits[index]), strict=True):
            if position < len(proposals[row]) and drawn == [proposals[row][position]]:
                kept[row] += 1
                if goes_on:
                    going.append(row)
        live = going
        position += 1
    return kept
