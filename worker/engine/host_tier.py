"""The prefix cache's host tier (``--kv-offload-bytes``): slots for evicted prefix blocks, LRU.

Bookkeeping only: the block registry (kv_blocks.py) moves entries here and back, and the copies it
queues are applied by the runner's wrapper (worker/attention/host_kv.py). Design: docs/worker.md.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# ``--kv-offload-bytes auto`` on CUDA: llama.cpp's --cache-ram default, or a quarter of the host's
# available memory where that is less.
AUTO_CAP_BYTES = 8 << 30
AUTO_HOST_SHARE = 4


@dataclass(frozen=True)
class Copy:
    """One queued block copy: ``to_host`` (device ``block`` -> host ``slot``) or back."""

    to_host: bool
    block: int
    slot: int


@dataclass(frozen=True)
class TierStats:
    """What /metrics shows of the tier: its slots, those in use, blocks brought back, bytes moved."""

    blocks: int
    used: int
    hits: int
    bytes_to_host: int
    bytes_to_device: int


class HostTier:
    """``slots`` host slots of ``block_bytes`` each: which registry entry holds which, evictable
    ones least recently stored first, and the copies not yet applied (in order)."""

    def __init__(self, slots: int, block_bytes: int):
        if slots < 1:
            raise ValueError(f"a host tier needs at least one slot, got {slots}")
        self.slots = slots
        self.block_bytes = block_bytes
        self._free: deque[int] = deque(range(slots))
        self._lru: OrderedDict[int, int] = OrderedDict()  # entry id -> slot; evictable, LRU first
        self._pinned: dict[int, int] = {}  # entry id -> slot: being brought back (not evictable)
        self._queue: list[Copy] = []
        self.hits = 0  # blocks brought back to the device for a prefix hit
        self.bytes_to_host = 0
        self.bytes_to_device = 0

    @property
    def used(self) -> int:
        """Slots holding a block."""
        return self.slots - len(self._free)

    def oldest(self) -> int | None:
        """The entry to evict for room (None: every held slot is pinned, or none is held)."""
        return next(iter(self._lru), None)

    def has_room(self) -> bool:
        return bool(self._free)

    def store(self, entry: int, block: int) -> None:
        """Moves ``entry`` from device ``block`` to a free slot (call :meth:`has_room` first)."""
        slot = self._free.popleft()
        self._lru[entry] = slot
        self._queue.append(Copy(True, block, slot))
        self.bytes_to_host += self.block_bytes

    def pin(self, entry: int) -> None:
        """Keeps ``entry``'s slot from eviction while a device block is found for it."""
        self._pinned[entry] = self._lru.pop(entry)

    def unpin(self, entry: int) -> None:
        """Makes ``entry`` evictable again (as the most recently stored)."""
        self._lru[entry] = self._pinned.pop(entry)

    def restore(self, entry: int, block: int) -> None:
        """Moves pinned ``entry`` back to device ``block``, freeing its slot."""
        slot = self._pinned.pop(entry)
        self._queue.append(Copy(False, block, slot))
        self._free.append(slot)
        self.hits += 1
        self.bytes_to_device += self.block_bytes

    def drop(self, entry: int) -> None:
        """Forgets ``entry``'s copy (its prefix was evicted), freeing its slot."""
        slot = self._lru.pop(entry, None)
        if slot is None:
            slot = self._pinned.pop(entry)
        self._free.append(slot)

    def stats(self) -> TierStats:
        return TierStats(self.slots, self.used, self.hits, self.bytes_to_host, self.bytes_to_device)

    def holds(self, entry: int) -> bool:
        return entry in self._lru or entry in self._pinned

    def drain(self) -> list[Copy]:
        """The copies queued since the last drain, in order (they must run before the next forward)."""
        queued, self._queue = self._queue, []
        return queued

    def audit(self, entries: int) -> str | None:
        """Checks the slots against the ``entries`` the registry keeps on the host; None when sound."""
        held = len(self._lru) + len(self._pinned)
        if held != entries or held + len(self._free) != self.slots:
            return f"host tier: {held} slot(s) held, {len(self._free)} free, {entries} host entries"
        return None


def tiered(
    execute: Callable[..., Any], tier: HostTier, apply: Callable[[Sequence[Copy]], None]
) -> Callable[..., Any]:
    """A runner's ``execute`` preceded by ``apply`` of the tier's queued copies, so every block a
    step reads holds its keys and values again before the forward starts."""

    def run(*args: Any, **kwargs: Any) -> Any:
        copies = tier.drain()
        if copies:
            apply(copies)
        return execute(*args, **kwargs)

    return run


def auto_offload_bytes(off: str | None, available: int | None) -> tuple[int, str]:
    """``--kv-offload-bytes auto``'s bytes and why, for the start-up log: 0 where ``off`` says why
    the tier is off (the CPU, a hybrid model...) or the host's ``available`` memory is unknown,
    else the smaller of :data:`AUTO_CAP_BYTES` and ``available / AUTO_HOST_SHARE``."""
    if off is not None:
        return 0, f"off ({off})"
    if available is None:
        return 0, "off (the host's available memory is unknown)"
    size = min(AUTO_CAP_BYTES, available // AUTO_HOST_SHARE)
    why = f"{size / 2**30:.2f} GiB (the smaller of {AUTO_CAP_BYTES / 2**30:.0f} GiB and a quarter of "
    return size, why + f"the host's {available / 2**30:.2f} GiB available)"


def available_host_bytes(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """The host memory available to new allocations without swapping: psutil's where installed,
    else ``MemAvailable`` of ``meminfo`` (None: neither)."""
    try:
        import psutil
    except ImportError:
        try:
            lines = meminfo.read_text().splitlines()
        except OSError:
            return None
        kib = [int(line.split()[1]) for line in lines if line.startswith("MemAvailable:")]
        return kib[0] * 1024 if kib else None
    return int(psutil.virtual_memory().available)
