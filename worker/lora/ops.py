"""The batched LoRA product of a step: each adapter's tokens shrunk to its rank and expanded back.

The seam for a device kernel (a Punica/S-LoRA style segmented matmul): :data:`LoraOps`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Group:
    """One adapter's share of a step: its slot, its rank, and its tokens' rows of the flat batch
    (a slice where they are contiguous, else an index tensor)."""

    slot: int
    rank: int
    rows: slice | torch.Tensor


# ``ops(x [N, in], a [slots, R, in], b [slots, out, R], groups, out [N, out])`` adds each group's
# ``x[rows] A_slot^T B_slot^T`` to ``out[rows]`` in place.
LoraOps = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Sequence[Group], torch.Tensor], None]


def grouped_torch(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, groups: Sequence[Group], out: torch.Tensor
) -> None:
    """The grouped shrink/expand with torch's matrix products: one pair per adapter in the step
    (base-model rows are in no group and untouched)."""
    for group in groups:
        shrink = a[group.slot, : group.rank]  # [r, in]
        expand = b[group.slot, :, : group.rank]  # [out, r]
        if isinstance(group.rows, slice):
            out[group.rows] += (x[group.rows] @ shrink.t()) @ expand.t()
        else:
            delta = (x.index_select(0, group.rows) @ shrink.t()) @ expand.t()
            out.index_add_(0, group.rows, delta)
