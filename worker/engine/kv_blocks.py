"""Who holds which block of the paged KV cache, and which blocks hold reusable prefixes.

Design notes: docs/worker.md.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from worker.engine.host_tier import HostTier

_ROOT = 0  # the chain id of "no block before this one"
_ON_HOST = -1  # an entry's block while its copy waits in the host tier


class OutOfBlocks(Exception):
    """Raised by :meth:`BlockManager.allocate` when neither a free nor a reusable block is left."""


@dataclass
class SequenceBlocks:
    """One sequence's block table and how far its prefix registration got."""

    table: list[int] = field(default_factory=list)
    # The entry id of the prefix this sequence's registered blocks end (``_ROOT`` for none), and how
    # many of its leading blocks have been through registration.
    chain_id: int = _ROOT
    registered: int = 0


@dataclass
class _Entry:
    id: int
    key: tuple[int, tuple[int, ...]]
    block: int
    children: set[int] = field(default_factory=set)


class BlockManager:
    """Allocation, reference counts and the prefix registry of ``num_blocks`` blocks of
    ``block_size`` tokens. Not thread-safe: the engine's scheduler owns it."""

    def __init__(self, num_blocks: int, block_size: int, *, prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"need at least one block of at least one token, got {num_blocks} x {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._refs = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._reusable: OrderedDict[int, None] = OrderedDict()  # registered, unreferenced; LRU first
        self._by_key: dict[tuple[int, tuple[int, ...]], _Entry] = {}
        self._by_id: dict[int, _Entry] = {}
        self._by_block: dict[int, _Entry] = {}
        self._ids = itertools.count(_ROOT + 1)
        # A hybrid model's state checkpoints (worker/engine/state_slots.py): a prefix is reusable
        # only up to an entry ``resumable`` accepts, and ``forgotten`` hears of each evicted entry.
        self.resumable: Callable[[int], bool] | None = None
        self.forgotten: Callable[[int], None] | None = None
        # --kv-offload-bytes (worker/engine/host_tier.py): evicted prefix blocks move there.
        self.tier: HostTier | None = None

    # ------------------------------------------------------------ counts

    @property
    def available(self) -> int:
        """Blocks an allocation can get now: free ones plus reusable (evictable) ones."""
        return len(self._free) + len(self._reusable)

    @property
    def used(self) -> int:
        """Blocks held by sequences (reusable prefix blocks nobody holds are not counted)."""
        return self.num_blocks - self.available

    @property
    def cached(self) -> int:
        """Registered blocks, held or not, host-tier ones included: the prefix cache's size in blocks."""
        return len(self._by_id)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    # -------------------------------------------------------- allocation

    def allocate(self) -> int:
        """One block with a reference count of 1; raises OutOfBlocks."""
        if self._free:
            block = self._free.popleft()
        elif self._reusable:
            block, _ = self._reusable.popitem(last=False)
            entry = self._by_block[block]
            if not self._demote(entry):
                self._forget(entry)
        else:
            raise OutOfBlocks
        self._refs[block] = 1
        return block

    def ensure(self, seq: SequenceBlocks, tokens: int) -> bool:
        """Grows the table to cover ``tokens`` slots; False (and no change) when the blocks are not
        available."""
        missing = self.blocks_for(tokens) - len(seq.table)
        if missing <= 0:
            return True
        if missing > self.available:
            return False
        seq.table += [self.allocate() for _ in range(missing)]
        return True

    def truncate(self, seq: SequenceBlocks, tokens: int) -> None:
        """Lets go of the blocks past the first ``tokens`` slots (never registered ones: registration
        stops at the computed tokens)."""
        keep = max(self.blocks_for(tokens), seq.registered)
        while len(seq.table) > keep:
            self._release(seq.table.pop())

    def free(self, seq: SequenceBlocks) -> None:
        """Lets go of every block of the sequence (last first, so shared first blocks stay longest)."""
        for block in reversed(seq.table):
            self._release(block)
        seq.table = []
        seq.chain_id = _ROOT
        seq.registered = 0

    def _release(self, block: int) -> None:
        refs = self._refs[block] - 1
        if refs < 0:
            raise RuntimeError(f"block {block} released more often than it was taken")
        self._refs[block] = refs
        if refs:
            return
        if block in self._by_block:
            self._reusable[block] = None
        else:
            self._free.append(block)

    def audit(self, tables: Iterable[SequenceBlocks]) -> str | None:
        """Checks the accounting against every live sequence's table: each block's reference count
        equals the tables holding it, and each unreferenced block is free or (registered) reusable,
        exactly once. Returns the first discrepancy found, or None. O(blocks): for failure paths."""
        expected = [0] * self.num_blocks
        for seq in tables:
            for block in seq.table:
                expected[block] += 1
        for block, (refs, want) in enumerate(zip(self._refs, expected, strict=True)):
            if refs != want:
                return f"block {block} has {refs} reference(s), {want} table(s) hold it"
        free, reusable = set(self._free), set(self._reusable)
        if len(free) != len(self._free) or free & reusable:
            return "a block is listed free twice, or both free and reusable"
        idle = {block for block, refs in enumerate(self._refs) if refs == 0}
        if free | reusable != idle:
            return f"{len(idle ^ (free | reusable))} block(s) held yet listed free, or idle yet unlisted"
        if not reusable <= self._by_block.keys():
            return "an unregistered block is listed reusable"
        if self.tier is not None:
            return self.tier.audit(sum(1 for e in self._by_id.values() if e.block == _ON_HOST))
        return None

    # ---------------------------------------------------- prefix registry

    def _chain(self, tokens: Sequence[int], limit: int) -> list[_Entry]:
        """Registered entries of the first whole blocks of ``tokens[:limit]``, in order, cut after
        the last entry ``resumable`` accepts (when set)."""
        chain = self._whole_chain(tokens, limit)
        if self.resumable is not None:
            while chain and not self.resumable(chain[-1].id):
                chain.pop()
        return chain

    def _whole_chain(self, tokens: Sequence[int], limit: int) -> list[_Entry]:
        """Registered entries of the first whole blocks of ``tokens[:limit]``, in order."""
        size = self.block_size
        chain: list[_Entry] = []
        parent = _ROOT
        for start in range(0, limit - size + 1, size):
            entry = self._by_key.get((parent, tuple(tokens[start : start + size])))
            if entry is None:
                break
            chain.append(entry)
            parent = entry.id
        return chain

    def cached_length(self, tokens: Sequence[int]) -> int:
        """What :meth:`attach_prefix` would reuse of ``tokens`` (no state changes)."""
        if not self.prefix_caching:
            return 0
        return len(self._chain(tokens, len(tokens) - 1)) * self.block_size

    def attach_prefix(self, seq: SequenceBlocks, tokens: Sequence[int]) -> int:
        """Starts an empty table with the registered blocks of ``tokens``' longest cached prefix that
        leaves at least one token to compute (its logits are needed); returns the prefix's length."""
        if seq.table:
            raise RuntimeError("attach_prefix needs a sequence without blocks")
        if not self.prefix_caching:
            return 0
        chain = self._take(self._chain(tokens, len(tokens) - 1))
        seq.table = [entry.block for entry in chain]
        seq.chain_id = chain[-1].id if chain else _ROOT
        seq.registered = len(chain)
        return len(chain) * self.block_size

    def commit(self, seq: SequenceBlocks, tokens: Sequence[int], computed: int) -> None:
        """Registers the sequence's blocks that ``computed`` tokens (of ``tokens``) now fill."""
        if not self.prefix_caching:
            return
        size = self.block_size
        while seq.registered < min(computed // size, len(seq.table)):
            if seq.chain_id != _ROOT and seq.chain_id not in self._by_id:
                return  # the prefix before this block was evicted: nothing below it is reachable
            index = seq.registered
            key = (seq.chain_id, tuple(tokens[index * size : (index + 1) * size]))
            entry = self._by_key.get(key)
            if entry is None:
                block = seq.table[index]
                if block in self._by_block:  # registered already under another key: cannot happen
                    return
                entry = _Entry(next(self._ids), key, block)
                self._by_key[key] = entry
                self._by_id[entry.id] = entry
                self._by_block[block] = entry
                parent = self._by_id.get(seq.chain_id)
                if parent is not None:
                    parent.children.add(entry.id)
            # else: the same prefix was computed by another sequence at the same time; this
            # sequence's copy stays unregistered and is freed when it ends.
            seq.chain_id = entry.id
            seq.registered += 1

    def _take(self, chain: list[_Entry]) -> list[_Entry]:
        """References ``chain``'s blocks, in order, bringing host-tier ones back to new device
        blocks (their copies queued); cut where a block cannot be found or an entry was evicted."""
        taken: list[_Entry] = []
        for entry in chain:
            if entry.id not in self._by_id:  # evicted with its prefix while blocks were found
                break
            if entry.block == _ON_HOST:
                if not self._fetch(entry):
                    break
            else:
                if self._refs[entry.block] == 0:
                    self._reusable.pop(entry.block, None)
                self._refs[entry.block] += 1
            taken.append(entry)
        return taken

    def _fetch(self, entry: _Entry) -> bool:
        """Gives host entry ``entry`` a device block again (referenced once); False when none is
        available. Its prefix is held already, so no eviction this causes can reach it."""
        assert self.tier is not None
        self.tier.pin(entry.id)
        try:
            block = self.allocate()
        except OutOfBlocks:
            self.tier.unpin(entry.id)
            return False
        self.tier.restore(entry.id, block)
        entry.block = block
        self._by_block[block] = entry
        return True

    def _demote(self, entry: _Entry) -> bool:
        """Moves evicted ``entry`` to the host tier (its block is the caller's now), making room by
        evicting the tier's oldest entries; False when there is no tier or no room."""
        tier = self.tier
        if tier is None:
            return False
        while not tier.has_room():
            oldest = tier.oldest()
            if oldest is None:
                return False
            self._forget(self._by_id[oldest])
            if entry.id not in self._by_id:  # it was below the evicted prefix: gone with it
                return True
        tier.store(entry.id, entry.block)
        del self._by_block[entry.block]
        entry.block = _ON_HOST
        return True

    def _forget(self, entry: _Entry) -> None:
        """Unregisters an entry and everything chained below it; unreferenced blocks become free."""
        for child_id in list(entry.children):
            child = self._by_id.get(child_id)
            if child is not None:
                self._forget(child)
        self._by_key.pop(entry.key, None)
        self._by_id.pop(entry.id, None)
        if self.forgotten is not None:
            self.forgotten(entry.id)
        parent = self._by_id.get(entry.key[0])
        if parent is not None:
            parent.children.discard(entry.id)
        if entry.block == _ON_HOST:
            assert self.tier is not None
            self.tier.drop(entry.id)
            return
        self._by_block.pop(entry.block, None)
        if self._refs[entry.block] == 0 and self._reusable.pop(entry.block, 0) is None:
            self._free.append(entry.block)

    def clear_cache(self) -> None:
        """Forgets every registered prefix (blocks in use stay in use)."""
        for entry in [e for e in self._by_id.values() if e.key[0] == _ROOT]:
            self._forget(entry)
