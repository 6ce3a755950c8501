"""The state cache of hybrid models: per recurrent layer, one fixed-size convolution state and one
recurrent (SSM / linear-attention) state per sequence slot, beside the paged KV pool.

Design notes: docs/worker.md ("The state cache of hybrid models").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StateShape:
    """One sequence's state in one layer: the conv state's dims and dtype, and the recurrent
    state's (None for a layer that keeps only a convolution state, e.g. LFM2's short convs)."""

    conv: tuple[int, ...]
    conv_dtype: torch.dtype
    recurrent: tuple[int, ...] | None = None
    recurrent_dtype: torch.dtype | None = None

    @property
    def bytes(self) -> int:
        """One slot's bytes in this layer."""
        total = _bytes(self.conv, self.conv_dtype)
        if self.recurrent is not None and self.recurrent_dtype is not None:
            total += _bytes(self.recurrent, self.recurrent_dtype)
        return total


def _bytes(dims: tuple[int, ...], dtype: torch.dtype) -> int:
    count = 1
    for size in dims:
        count *= size
    return count * torch.empty((), dtype=dtype).element_size()


class StatePool:
    """``slots`` sequence slots, one scratch slot (index ``slots``: rows that belong to no
    sequence, such as the warm-up's, write there) and ``checkpoints`` snapshots (prefix reuse,
    worker/engine/state_slots.py) of every recurrent layer's states, keyed by the layer index:
    ``conv[layer]`` ``[slots + 1 + checkpoints, *shape.conv]``, ``recurrent[layer]`` likewise."""

    def __init__(
        self, shapes: Mapping[int, StateShape], slots: int, device: torch.device, checkpoints: int = 0
    ):
        if slots < 1:
            raise ValueError(f"the state pool needs at least one slot, got {slots}")
        self.shapes = dict(shapes)
        self.slots = slots
        self.scratch = slots
        self.checkpoints = checkpoints
        rows = slots + 1 + checkpoints
        self.conv: dict[int, torch.Tensor] = {}
        self.recurrent: dict[int, torch.Tensor] = {}
        for layer, shape in self.shapes.items():
            self.conv[layer] = torch.zeros((rows, *shape.conv), dtype=shape.conv_dtype, device=device)
            if shape.recurrent is not None and shape.recurrent_dtype is not None:
                self.recurrent[layer] = torch.zeros(
                    (rows, *shape.recurrent), dtype=shape.recurrent_dtype, device=device
                )

    @property
    def slot_bytes(self) -> int:
        """One sequence's state over every recurrent layer."""
        return sum(shape.bytes for shape in self.shapes.values())

    @property
    def bytes(self) -> int:
        """Every slot's state, the scratch slot and the checkpoints included (what the pool
        allocated)."""
        return (self.slots + 1 + self.checkpoints) * self.slot_bytes

    def slot_of(self, slot: int) -> int:
        """The pool index of a sequence's slot; -1 (no sequence) is the scratch slot."""
        if slot >= self.slots:
            raise ValueError(f"state slot {slot} is past the pool's {self.slots} slots")
        return self.scratch if slot < 0 else slot

    def checkpoint(self, index: int) -> int:
        """The pool index of checkpoint ``index``."""
        if not 0 <= index < self.checkpoints:
            raise ValueError(f"state checkpoint {index} is past the pool's {self.checkpoints}")
        return self.slots + 1 + index

    def copy(self, source: int, target: int) -> None:
        """Copies every layer's state of slot ``source`` into slot ``target`` (a fork)."""
        for states in (self.conv, self.recurrent):
            for tensor in states.values():
                tensor[target].copy_(tensor[source])
