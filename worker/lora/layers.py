"""The model's attention and MLP projections wrapped for LoRA (whole, or a tensor-parallel rank's
cut of them), the adapters' device slots, and a step's plan of which tokens use which slot.

Design notes: docs/worker.md ("LoRA adapters").
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import cast

import torch

from worker.lora.adapter import LoraWeights
from worker.lora.ops import Group, LoraOps, RowLoraOps, grouped_torch, slotted_torch
from worker.types import LoraHandle

# A decoder layer's attention or MLP projection: ``…layers.<n>.<block>.<projection>`` with a block
# and projection named as the transformers families name them; no MoE expert, no vision tower, no
# recurrent mixer (called on groups of rows, which a step's plan does not describe).
_DECODER = re.compile(r"(^|\.)layers\.\d+\.(self_attn|attn|attention|mlp|feed_forward)\.(\w+)$")
_PROJECTIONS = frozenset(
    [
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "qkv_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
        "gate_up_proj",
        "dense",
        "query_key_value",
        "fc1",
        "fc2",
        "c_attn",
        "c_proj",
        "c_fc",
        "out_proj",
        "wqkv",
        "wo",
    ]
)
_SKIPPED = ("expert", "vision", "visual")
# A module's attribute naming its children cut by tensor parallelism: ``{child: Cut}``.
CUTS = "lora_cuts"


@dataclass(frozen=True)
class Cut:
    """The share of a whole projection a tensor-parallel rank computes: the whole one's ``(in, out)``
    ``features`` (what adapters are checked against), and its output ``rows`` (column-parallel: B's
    rows, A whole) or input ``columns`` (row-parallel: A's columns, B whole); ``inner``: the child
    holding the rank's partial product (row-parallel: the LoRA term joins it before the sum)."""

    features: tuple[int, int]
    rows: slice = field(default_factory=lambda: slice(None))
    columns: slice = field(default_factory=lambda: slice(None))
    inner: str = ""


class LoraPlan:
    """A step's tokens by adapter: the groups every wrapped layer adds its product for, and each
    token's slot (-1: the base model) as the decode graphs stage it (worker/model/cuda_graphs.py)."""

    def __init__(self, tokens: int, groups: Sequence[Group], row_slots: Sequence[int] = ()):
        self.tokens = tokens
        self.groups = tuple(groups)
        self.row_slots = tuple(row_slots)


class RowSlots:
    """A captured decode step's plan: each row's slot in a device tensor (-1: none), a graph input
    the replays read (the step's adapter mix is in the tensor's values, not in the launches)."""

    def __init__(self, slots: torch.Tensor):
        self.tokens = slots.shape[0]
        self.slots = slots


class LoraLinear(torch.nn.Module):
    """A projection (float, packed or weight-only quantized) plus the LoRA product of the step's
    adapters: ``y = base(x) + x A_s^T B_s^T`` for the rows of adapter slot ``s``."""

    def __init__(
        self, base: torch.nn.Module, owner: LoraLayers, slots: int, rank: int, cut: Cut | None = None
    ):
        super().__init__()
        self.base = base
        self.in_features = int(cast(int, base.in_features))
        self.out_features = int(cast(int, base.out_features))
        # None: the whole projection; else the part of the adapters' A and B this rank's shard takes.
        self.cut = cut
        self._owner = [owner]  # a list: not a submodule
        self.lora_a: torch.Tensor
        self.lora_b: torch.Tensor
        dtype, device = owner.dtype, owner.device
        self.register_buffer("lora_a", torch.zeros(slots, rank, self.in_features, dtype=dtype, device=device))
        self.register_buffer(
            "lora_b", torch.zeros(slots, self.out_features, rank, dtype=dtype, device=device)
        )

    @property
    def weight(self) -> torch.Tensor:
        """The base layer's weight, for model code that reads its dtype or device."""
        return cast(torch.Tensor, self.base.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        owner = self._owner[0]
        plan = owner.plan
        if plan is None or (isinstance(plan, LoraPlan) and not plan.groups):
            return y
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] != plan.tokens:
            raise RuntimeError(f"a LoRA step planned {plan.tokens} tokens, the layer got {rows.shape[0]}")
        out = y.reshape(-1, self.out_features)
        if isinstance(plan, RowSlots):
            owner.row_ops(rows, self.lora_a, self.lora_b, plan.slots, out)
        else:
            owner.ops(rows, self.lora_a, self.lora_b, plan.groups, out)
        return out.view(y.shape) if out.data_ptr() != y.data_ptr() else y


def _wrappable(name: str, module: torch.nn.Module) -> bool:
    match = _DECODER.search(name)
    if match is None or match.group(3) not in _PROJECTIONS or any(word in name for word in _SKIPPED):
        return False
    return isinstance(getattr(module, "in_features", None), int) and isinstance(
        getattr(module, "out_features", None), int
    )


def _sites(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, str, Cut | None]]:
    """Each projection to wrap: its path (the adapters' module name), the module holding the wrapped
    child, the child's name there, and its tensor-parallel cut (None: whole). A cut projection is
    wrapped at its ``inner`` child when it has one (a row-parallel shard's partial product)."""
    sites: list[tuple[str, torch.nn.Module, str, Cut | None]] = []
    for name, module in model.named_modules():
        parent_name, _, leaf = name.rpartition(".")
        cut = getattr(model.get_submodule(parent_name), CUTS, {}).get(leaf) if name else None
        if cut is not None and cut.inner:
            if _wrappable(name, module.get_submodule(cut.inner)):
                sites.append((name, module, cut.inner, cut))
        elif _wrappable(name, module):
            sites.append((name, model.get_submodule(parent_name), leaf, cut))
    return sites


class LoraLayers:
    """Every wrapped projection of one model, ``max_loras`` device slots of rank ``max_rank`` each
    (least recently used refilled first) and the plan of the step running now. ``ops``: the grouped
    product of eager steps; ``row_ops``: the per-row one the decode graphs capture. The slots are
    allocated once: loading an adapter copies into them in place, so captured graphs see it."""

    def __init__(
        self,
        model: torch.nn.Module,
        max_loras: int,
        max_rank: int,
        ops: LoraOps = grouped_torch,
        row_ops: RowLoraOps = slotted_torch,
    ):
        first = next(model.parameters())
        self.dtype, self.device = first.dtype, first.device
        self.max_loras, self.max_rank, self.ops, self.row_ops = max_loras, max_rank, ops, row_ops
        self.plan: LoraPlan | RowSlots | None = None
        self._slots: OrderedDict[int, int] = OrderedDict()  # adapter uid -> slot, least recent first
        self._ranks: dict[int, int] = {}
        self.layers: dict[str, LoraLinear] = {}
        for name, holder, child, cut in _sites(model):
            wrapped = LoraLinear(holder.get_submodule(child), self, max_loras, max_rank, cut)
            setattr(holder, child, wrapped)
            self.layers[name] = wrapped
        if not self.layers:
            raise ValueError("the model has no attention or MLP projections to apply LoRA adapters to")

    @property
    def targets(self) -> dict[str, tuple[int, int]]:
        """Each wrapped module's path and ``(in, out)`` features (what adapters are checked against):
        the whole projection's where this rank holds a cut of it."""
        return {
            name: layer.cut.features if layer.cut else (layer.in_features, layer.out_features)
            for name, layer in self.layers.items()
        }

    def holds(self, uid: int) -> bool:
        """Whether the adapter of ``uid`` is in a slot now (a step that names it copies nothing)."""
        return uid in self._slots

    def slot_of(self, adapter: LoraHandle, keep: set[int]) -> int:
        """``adapter``'s slot, its weights copied in if it holds none (the least recently used slot
        not in ``keep``, the uids this step needs, is refilled)."""
        if adapter.uid in self._slots:
            self._slots.move_to_end(adapter.uid)
            return self._slots[adapter.uid]
        if adapter.weights is None:  # a follower told it by name: rank 0's slots held it, these do not
            raise RuntimeError(
                f"LoRA adapter {adapter.name!r} (uid {adapter.uid}) is in no slot and came without weights"
            )
        if len(self._slots) < self.max_loras:
            slot = len(self._slots)
        else:
            victim = next((uid for uid in self._slots if uid not in keep), None)
            if victim is None:
                raise RuntimeError(f"a step holds more than --max-loras {self.max_loras} adapters")
            slot = self._slots.pop(victim)
        self._fill(slot, cast(LoraWeights, adapter.weights))
        self._slots[adapter.uid] = slot
        self._ranks[slot] = cast(LoraWeights, adapter.weights).rank
        return slot

    @torch.no_grad()
    def _fill(self, slot: int, weights: LoraWeights) -> None:
        for name, layer in self.layers.items():
            layer.lora_a[slot].zero_()
            layer.lora_b[slot].zero_()
            pair = weights.modules.get(name)
            if pair is not None:
                a, b = pair
                if layer.cut is not None:  # this rank's share: A's input columns, B's output rows
                    a, b = a[:, layer.cut.columns], b[layer.cut.rows]
                layer.lora_a[slot, : a.shape[0]].copy_(a)
                layer.lora_b[slot, :, : b.shape[1]].copy_(b)

    def plan_of(self, runs: Sequence[tuple[LoraHandle | None, int]]) -> LoraPlan | None:
        """The plan of a step whose flat tokens are ``runs`` of ``(adapter or None, count)`` in
        order; None when no token uses an adapter."""
        if all(adapter is None for adapter, _ in runs):
            return None
        keep = {adapter.uid for adapter, _ in runs if adapter is not None}
        rows: dict[int, list[int]] = {}
        row_slots: list[int] = []
        start = 0
        for adapter, count in runs:
            slot = -1 if adapter is None else self.slot_of(adapter, keep)
            if slot >= 0:
                rows.setdefault(slot, []).extend(range(start, start + count))
            row_slots += [slot] * count
            start += count
        groups = [
            Group(slot, self._ranks[slot], _rows(indexes, self.device)) for slot, indexes in rows.items()
        ]
        return LoraPlan(start, groups, row_slots)

    @contextmanager
    def step(self, runs: Sequence[tuple[LoraHandle | None, int]]) -> Iterator[LoraPlan | None]:
        """The wrapped layers add the adapters' products for these runs of tokens while inside."""
        self.plan = self.plan_of(runs)
        try:
            yield self.plan
        finally:
            self.plan = None

    @contextmanager
    def rows_step(self, slots: torch.Tensor) -> Iterator[None]:
        """The wrapped layers add each row's adapter product, its slot read from ``slots`` (a graph
        input, -1: none), while inside; the plan before is restored after."""
        before, self.plan = self.plan, RowSlots(slots)
        try:
            yield
        finally:
            self.plan = before


def _rows(indexes: list[int], device: torch.device) -> slice | torch.Tensor:
    if indexes[-1] - indexes[0] + 1 == len(indexes):
        return slice(indexes[0], indexes[-1] + 1)
    return torch.tensor(indexes, dtype=torch.long, device=device)
