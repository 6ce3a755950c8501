"""LoRA adapters under tensor parallelism: the cut of each sharded projection that the wrapped layers
take their share of an adapter's A and B by, and the adapters' weights told to the followers in the
step that first copies them into a device slot. Design notes: docs/worker.md, "Tensor parallelism"."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from torch import nn

from worker.lora.layers import CUTS, Cut, LoraLayers
from worker.model.step_inputs import Work
from worker.types import LoraHandle


def note_cut(parent: nn.Module, child: str, cut: Cut) -> None:
    """Records that ``parent.child`` is a cut of a whole projection (read by
    :class:`worker.lora.layers.LoraLayers`; the record stays when the child is quantized or packed)."""
    cuts = getattr(parent, CUTS, None)
    if cuts is None:
        cuts = {}
        setattr(parent, CUTS, cuts)
    cuts[child] = cut


def column_cut(linear: nn.Linear, first: int, count: int) -> Cut:
    """A column-parallel shard's cut: output rows ``first .. first + count`` (the adapter's B rows)."""
    return Cut((linear.in_features, linear.out_features), rows=slice(first, first + count))


def row_cut(linear: nn.Linear, first: int, width: int, inner: str) -> Cut:
    """A row-parallel shard's cut: input columns ``first .. first + width`` (the adapter's A columns),
    its partial product in child ``inner``, to which the adapter's term is added before the sum."""
    return Cut((linear.in_features, linear.out_features), columns=slice(first, first + width), inner=inner)


def told_handle(handle: LoraHandle | None, lora: LoraLayers | None) -> LoraHandle | None:
    """``handle`` as the followers are told it: its weights only when rank 0's slots lack the
    adapter (this step copies it into the slot every rank then picks alike), else name and uid."""
    if handle is None or lora is None or not lora.holds(handle.uid):
        return handle
    return dataclasses.replace(handle, weights=None)


def told_work(work: Sequence[Work], lora: LoraLayers | None) -> list[Work]:
    """A step's work as the followers are told it: without its sequences, adapters' weights only
    where the step fills a slot with them (one copy however many rows hold the adapter)."""
    handles: dict[int, LoraHandle | None] = {}
    items = []
    for item in work:
        handle = item.lora
        if handle is not None:
            handle = handles.setdefault(handle.uid, told_handle(handle, lora))
        items.append(dataclasses.replace(item, seq=None, lora=handle))
    return items
