"""What a step's forward reads: each sequence's part of the step and the flat inputs built from it.

Shared by the runner (eager steps) and the CUDA graphs (replayed decode steps), so neither depends
on the other for its inputs (the role SGLang's ``forward_batch_info`` plays).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Work:
    """One sequence's part of a step: compute ``tokens`` at positions ``start..``, whose slots the
    block table covers; ``sample``: the last token's logits are wanted (it ends the known tokens)."""

    tokens: Sequence[int]
    start: int
    table: Sequence[int]
    sample: bool
    generated: int = 0  # tokens the sequence has generated so far (a fake runner picks from it)


def slots(item: Work, block_size: int) -> list[int]:
    """The pool slot (block * block_size + offset) of each of ``item``'s tokens."""
    table, size = item.table, block_size
    return [table[p // size] * size + p % size for p in range(item.start, item.start + len(item.tokens))]


def decode_tables(
    work: Sequence[Work], block_size: int, rows: int, width: int, dtype: torch.dtype
) -> torch.Tensor:
    """Block tables ``[rows, width]`` (on the CPU) of decode items: row ``i`` lists the blocks that hold
    item ``i``'s context, the current token included; other entries (and rows past ``work``) are 0."""
    tables = torch.zeros((rows, width), dtype=dtype)
    for row, item in enumerate(work):
        used = -(-(item.start + 1) // block_size)
        tables[row, :used] = torch.tensor(list(item.table[:used]), dtype=dtype)
    return tables


@dataclass
class FlatTokens:
    """A step's items as one flat token sequence: ids, positions and pool slots per token, where
    each item starts, and which tokens' logits are kept (each sampling item's last)."""

    ids: list[int]
    positions: list[int]
    slots: list[int]
    starts: list[int]
    keep: list[int]

    @classmethod
    def of(cls, work: Sequence[Work], block_size: int) -> FlatTokens:
        flat = cls([], [], [], [], [])
        for item in work:
            flat.starts.append(len(flat.ids))
            flat.ids += item.tokens
            flat.positions += range(item.start, item.start + len(item.tokens))
            flat.slots += slots(item, block_size)
            if item.sample:
                flat.keep.append(len(flat.ids) - 1)
        return flat

    def slot_tensor(self, device: torch.device) -> torch.Tensor:
        return torch.tensor(self.slots, dtype=torch.long, device=device)
