"""What a step's forward reads: each sequence's part of the step and the flat inputs built from it.

Shared by the runner (eager steps) and the CUDA graphs (replayed decode steps), so neither depends
on the other for its inputs (the role SGLang's ``forward_batch_info`` plays).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from worker.device.staging import staged
from worker.types import LoraHandle, PromptImage


@dataclass(frozen=True)
class ChunkImage:
    """The part of one image a prefill chunk computes: ``rows`` of its features from ``first``
    (the placeholders the chunk holds, in order); ``inputs``: the processor's arrays for the
    encoder; ``span``: the image's placeholder positions ``[start, end)`` in the sequence."""

    inputs: Any  # Mapping[str, numpy array], one image's
    first: int
    rows: int
    span: tuple[int, int]


@dataclass(slots=True)  # not frozen: one per sequence per step (see worker/types.py's ContentDelta)
class Work:
    """One sequence's part of a step: compute ``tokens`` at positions ``start..``, whose slots the
    block table covers; ``sample``: the last token's logits are wanted (it ends the known tokens);
    ``proposed``: the last tokens are that many speculative proposals, and the logits of each and of
    the token before them are wanted (``sample`` is true). The scheduler plans steps as these
    (:func:`work_of`); ``seq`` is its sequence, which the engine commits after the forward."""

    tokens: Sequence[int]
    start: int
    table: Sequence[int]
    sample: bool
    generated: int = 0  # tokens the sequence has generated so far (a fake runner picks from it)
    proposed: int = 0
    images: tuple[ChunkImage, ...] = ()  # the images whose placeholders ``tokens`` hold
    # M-RoPE models: where each of the sequence's images starts and its token grid (time, rows,
    # columns), and how far they move the positions after them (a decode row's offset).
    grids: tuple[tuple[int, tuple[int, int, int]], ...] = ()
    position_delta: int = 0
    seq: Any = field(
        default=None, compare=False, repr=False
    )  # the planner's sequence (the runner never reads it)
    # A hybrid model's state slot of the sequence (worker/engine/state_slots.py); -1: none (the
    # rows of the state pool's scratch slot, e.g. the warm-up's).
    state_slot: int = -1
    # State checkpoints (worker/engine/state_slots.py): copied into the slot before the forward (a
    # prefix resumed), and the slot copied into after it (a chunk that ends at a boundary); -1: none.
    state_from: int = -1
    state_to: int = -1
    lora: LoraHandle | None = None  # the sequence's LoRA adapter (None: the base model)

    @property
    def count(self) -> int:
        """The sequence's known tokens this computes (its proposals left out)."""
        return len(self.tokens) - self.proposed

    @property
    def proposals(self) -> tuple[int, ...]:
        """The speculative tokens this verifies, after the sequence's last known token."""
        return tuple(self.tokens[len(self.tokens) - self.proposed :]) if self.proposed else ()


class PlannedSequence(Protocol):
    """What :func:`work_of` reads of a sequence (the scheduler's ``SeqState``)."""

    @property
    def tokens(self) -> list[int]: ...
    @property
    def computed(self) -> int: ...
    @property
    def generated(self) -> int: ...
    @property
    def table(self) -> list[int]: ...
    @property
    def images(self) -> tuple[PromptImage, ...]: ...
    @property
    def state_slot(self) -> int: ...
    @property
    def lora(self) -> LoraHandle | None: ...


def work_of(seq: PlannedSequence, count: int, proposals: tuple[int, ...] = ()) -> Work:
    """``seq``'s part of a step: ``count`` of its tokens from ``computed`` on, then ``proposals``
    (speculative tokens to verify after a decoding sequence's last token); the images they hold."""
    start, end = seq.computed, seq.computed + count
    sample = end == len(seq.tokens)
    tokens = [*seq.tokens[start:end], *proposals]
    if not seq.images:  # the common row: no image parts, no M-RoPE offsets
        return Work(
            tokens,
            start,
            seq.table,
            sample,
            seq.generated,
            len(proposals),
            seq=seq,
            state_slot=seq.state_slot,
            lora=seq.lora,
        )
    grids = tuple(
        (image.start, (image.grid[0], image.grid[1], image.grid[2])) for image in seq.images if image.grid
    )
    chunk = tuple(
        ChunkImage(
            image.inputs,
            image.placeholders(image.start, start),
            image.placeholders(start, end),
            (image.start, image.end),
        )
        for image in seq.images
        if image.start < end and start < image.end
    )
    return Work(
        tokens,
        start,
        seq.table,
        sample,
        seq.generated,
        len(proposals),
        chunk,
        grids,
        mrope_delta(grids, start),
        seq,
        seq.state_slot,
        lora=seq.lora,
    )


def mrope_delta(grids: Sequence[tuple[int, tuple[int, int, int]]], position: int) -> int:
    """How far M-RoPE moves ``position`` (a decode row's offset): by the images that end at or
    before it (a one-token prompt chunk before an image runs as a decode row too, unmoved)."""
    return sum(
        max(rows, columns) - frames * rows * columns
        for start, (frames, rows, columns) in grids
        if start + frames * rows * columns <= position
    )


def is_decode_row(item: Work) -> bool:
    """``item`` runs as decode rows: one new token, or one and the proposals it verifies (no image)."""
    return not item.images and len(item.tokens) == 1 + item.proposed


def token_rows(item: Work) -> list[Work]:
    """A decode row's item as one-token rows: a verifying row's tokens each at its position, seeing
    the context up to itself (the keys of all of them are written before any attends), so its
    proposals are scored as one-token steps would score them, by the same decode path."""
    if not item.proposed:
        return [item]
    return [
        Work(
            (token,),
            item.start + i,
            item.table,
            True,
            item.generated,
            position_delta=item.position_delta,
            state_slot=item.state_slot,
        )
        for i, token in enumerate(item.tokens)
    ]


def slots(item: Work, block_size: int) -> list[int]:
    """The pool slot (block * block_size + offset) of each of ``item``'s tokens."""
    table, size = item.table, block_size
    return [table[p // size] * size + p % size for p in range(item.start, item.start + len(item.tokens))]


def _table_rows(work: Sequence[Work], block_size: int, width: int) -> list[list[int]]:
    """Each decode item's used blocks (its context, the current token included), padded with 0."""
    rows = []
    for item in work:
        used = list(item.table[: -(-(item.start + 1) // block_size)])
        rows.append(used + [0] * (width - len(used)))
    return rows


@dataclass(frozen=True)
class DecodeInputs:
    """A decode-only step's inputs on the device: ids and positions ``[rows, 1]``, pool slots and
    context lengths ``[rows]``, block tables ``[rows, width]``."""

    ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    lengths: torch.Tensor
    tables: torch.Tensor


def fed_ids(ids: torch.Tensor, fed: torch.Tensor | None) -> torch.Tensor:
    """``ids`` (on the device) with each placeholder, ``-(row + 1)``, replaced by ``fed[row]``: a
    token the previous step drew on the device, which the host has not read yet (docs/worker.md,
    "Steps that overlap")."""
    if fed is None:
        return ids
    return torch.where(ids < 0, fed[(-ids - 1).clamp(min=0)], ids)


def decode_inputs(
    work: Sequence[Work],
    block_size: int,
    device: torch.device,
    index_type: torch.dtype,
    fed: torch.Tensor | None = None,
) -> DecodeInputs:
    """Every decode input of ``work`` (one token per item) in one host tensor and one copy; ids that
    are placeholders are taken from ``fed`` (:func:`fed_ids`)."""
    width = -(-max(item.start + 1 for item in work) // block_size)
    tables = _table_rows(work, block_size, width)
    size = block_size
    host = [
        [
            item.tokens[0],
            item.start + item.position_delta,
            row[item.start // size] * size + item.start % size,
            item.start + 1,
            *row,
        ]
        for item, row in zip(work, tables, strict=True)
    ]
    packed = staged(host, torch.long, device)

    def column(part: torch.Tensor, dtype: torch.dtype = torch.long) -> torch.Tensor:
        # Standard strides even for one row (``contiguous()`` keeps a size-1 dimension's stride,
        # which the Triton kernel's checks read).
        return part.to(dtype).clone(memory_format=torch.contiguous_format)

    return DecodeInputs(
        ids=fed_ids(column(packed[:, 0:1]), fed),
        positions=column(packed[:, 1:2]),
        slots=column(packed[:, 2]),
        lengths=column(packed[:, 3], index_type),
        tables=column(packed[:, 4:], index_type),
    )


@dataclass
class FlatTokens:
    """A step's items as one flat token sequence: ids, positions and pool slots per token, where
    each item starts, and which tokens' logits are kept (each sampling item's last, and a verifying
    item's proposals with the token before them)."""

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
                flat.keep += range(len(flat.ids) - 1 - item.proposed, len(flat.ids))
        return flat

    def slot_tensor(self, device: torch.device) -> torch.Tensor:
        return torch.tensor(self.slots, dtype=torch.long, device=device)
