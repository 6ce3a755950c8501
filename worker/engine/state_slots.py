"""Which running sequence holds which slot of a hybrid model's state pool (bookkeeping only: the
tensors are worker/attention/state_pool.py's).

Design notes: docs/worker.md ("The state cache of hybrid models").
"""

from __future__ import annotations

from collections import OrderedDict


class StateSlots:
    """``count`` slots, one per running sequence: a sequence takes one when it is first planned
    (or planned again after a preemption) and gives it back when it finishes, is preempted or
    removed. The scheduler runs at most ``count`` sequences, so a slot is always free for one."""

    def __init__(self, count: int):
        self.count = count
        self._free = list(range(count - 1, -1, -1))  # popped from the end: lowest first

    @property
    def free(self) -> int:
        return len(self._free)

    def take(self) -> int:
        if not self._free:
            raise RuntimeError(f"every one of the {self.count} state slots is held")
        return self._free.pop()

    def give(self, slot: int) -> None:
        """Returns ``slot`` (-1, no slot, is ignored)."""
        if slot < 0:
            return
        if slot in self._free or slot >= self.count:
            raise RuntimeError(f"state slot {slot} given back twice or unknown")
        self._free.append(slot)


# A checkpoint every this many blocks of a prompt (and one at the last block boundary before its end).
CHECKPOINT_EVERY_BLOCKS = 16


class Checkpoints:
    """A hybrid model's state checkpoints: ``count`` snapshots of a sequence's state at a block
    boundary of its prompt, each bound to the prefix registry's entry of the block that ends there
    (worker/engine/kv_blocks.py), so a later sequence with that prefix resumes from it. Boundaries:
    every ``every`` blocks and the last one before the prompt's end. A snapshot is reserved when a
    step's chunk ends at a boundary (the runner copies the slot there after the forward), bound
    when the step commits, dropped when its entry is evicted, and taken back least recently used
    first when none is free."""

    def __init__(self, count: int, block_size: int, every: int = CHECKPOINT_EVERY_BLOCKS):
        self.count = count
        self.block_size = block_size
        self.every = every
        self._free = list(range(count - 1, -1, -1))
        self._bound: OrderedDict[int, int] = OrderedDict()  # entry id -> checkpoint, LRU first
        self._pending: dict[int, int] = {}  # checkpoint -> the schedule that reserved it
        self._schedules = 0

    def boundary(self, start: int, end: int, prompt_length: int) -> int | None:
        """The first checkpoint boundary strictly between ``start`` and ``end``, or None."""
        size = self.block_size
        last = (prompt_length - 1) // size * size
        step = self.every * size
        candidates = [last] if start < last < end else []
        first = (start // step + 1) * step
        if first < end:
            candidates.append(first)
        return min(candidates) if candidates else None

    def is_boundary(self, end: int, prompt_length: int) -> bool:
        """Whether a chunk ending at ``end`` ends at a checkpoint boundary of its prompt."""
        size = self.block_size
        return end > 0 and (end == (prompt_length - 1) // size * size or end % (self.every * size) == 0)

    @property
    def bound(self) -> int:
        """Checkpoints bound to a prefix now."""
        return len(self._bound)

    def resumable(self, entry: int) -> bool:
        return entry in self._bound

    def of(self, entry: int) -> int:
        """The checkpoint bound to ``entry`` (used now: the last to be taken back)."""
        self._bound.move_to_end(entry)
        return self._bound[entry]

    def new_schedule(self) -> None:
        """Takes back reservations two schedules old whose step never committed (a failed step)."""
        self._schedules += 1
        for checkpoint, when in list(self._pending.items()):
            if when < self._schedules - 2:
                del self._pending[checkpoint]
                self._free.append(checkpoint)

    def reserve(self) -> int:
        """A checkpoint for a chunk's end state (-1: none free or reclaimable)."""
        if not self._free and self._bound:
            _, checkpoint = self._bound.popitem(last=False)
            self._free.append(checkpoint)
        if not self._free:
            return -1
        checkpoint = self._free.pop()
        self._pending[checkpoint] = self._schedules
        return checkpoint

    def bind(self, checkpoint: int, entry: int | None) -> None:
        """The step that wrote ``checkpoint`` committed: bound to ``entry`` (None, or an entry that
        has one already: given back)."""
        if self._pending.pop(checkpoint, None) is None:
            return  # taken back meanwhile
        if entry is None or entry in self._bound:
            self._free.append(checkpoint)
            return
        self._bound[entry] = checkpoint

    def forget(self, entry: int) -> None:
        """``entry`` was evicted from the prefix registry: its checkpoint is free again."""
        checkpoint = self._bound.pop(entry, None)
        if checkpoint is not None:
            self._free.append(checkpoint)


def state_checkpoints(runner: object) -> int:
    """How many state checkpoints ``runner``'s state pool holds (0: not a hybrid model)."""
    states = getattr(runner, "states", None)
    return int(getattr(states, "checkpoints", 0)) if states is not None else 0
