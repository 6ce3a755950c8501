"""Reusable KV of prompt prefixes: block-granular, exact-match, LRU-bounded.

A prompt is cut into blocks of :data:`BLOCK_TOKENS` token ids. Block ``k`` of a
prompt is stored under the key ``(id of block k-1's entry, the block's ids)``,
so a key names the whole prefix exactly (no hashing, so no collisions) while
each entry holds only its own block's keys and values, one ``[kv_heads,
BLOCK_TOKENS, head_dim]`` pair per layer, on the model's device. A lookup walks
the chain from the first block and returns the longest stored prefix.

The cache holds at most ``capacity_tokens`` tokens. When full, the least
recently used entry goes, and with it every entry below it in the chain (they
could no longer be reached). Each use touches a chain from its deepest block
to its first, so a prefix's first blocks, shared by the most prompts, are the
last to go.

Causal attention makes a prefix's KV independent of what follows it, and the
positions of a prefix are always ``0..P-1``, so reusing it gives the same
result as computing it again (up to float rounding of a different batch
shape, as any batching does).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

# Smaller blocks reuse more of a shared prefix (a chat template's ~25-token system prompt: 24 tokens
# at 8, 16 at 16) for more, smaller entries; 8 measured best on the default model.
BLOCK_TOKENS = 8

# One layer's (keys, values), each [kv_heads, tokens, head_dim].
LayerKV = tuple[torch.Tensor, torch.Tensor]


@dataclass
class _Entry:
    id: int
    key: tuple[int, tuple[int, ...]]
    layers: list[LayerKV]
    children: set[int] = field(default_factory=set)


class PrefixCache:
    """Maps token-id prefixes (whole blocks) to their per-layer KV. Not thread-safe: the engine
    thread owns it."""

    def __init__(self, capacity_tokens: int, block_tokens: int = BLOCK_TOKENS):
        if capacity_tokens < 0 or block_tokens < 1:
            raise ValueError("capacity_tokens must be >= 0 and block_tokens >= 1")
        self.capacity_tokens = capacity_tokens
        self.block_tokens = block_tokens
        self._by_key: dict[tuple[int, tuple[int, ...]], _Entry] = {}
        # Entries by id in LRU order (oldest first).
        self._lru: OrderedDict[int, _Entry] = OrderedDict()
        self._ids = itertools.count(1)  # 0 is the root: "no block before this one"

    @property
    def enabled(self) -> bool:
        return self.capacity_tokens >= self.block_tokens

    @property
    def tokens(self) -> int:
        """Tokens held now."""
        return len(self._lru) * self.block_tokens

    def _blocks(self, prompt: Sequence[int], limit: int) -> list[tuple[int, ...]]:
        size = self.block_tokens
        return [tuple(prompt[i : i + size]) for i in range(0, limit - size + 1, size)]

    def _chain(self, prompt: Sequence[int], limit: int) -> list[_Entry]:
        """The stored entries of the prompt's first blocks within ``limit`` tokens, in order."""
        chain: list[_Entry] = []
        parent = 0
        for block in self._blocks(prompt, limit):
            entry = self._by_key.get((parent, block))
            if entry is None:
                break
            chain.append(entry)
            parent = entry.id
        return chain

    def _touch(self, chain: list[_Entry]) -> None:
        for entry in reversed(chain):  # the first block ends up most recent
            self._lru.move_to_end(entry.id)

    def cached_length(self, prompt: Sequence[int]) -> int:
        """What :meth:`lookup` would reuse of ``prompt`` (without touching the LRU order)."""
        if not self.enabled:
            return 0
        return len(self._chain(prompt, len(prompt) - 1)) * self.block_tokens

    def lookup(self, prompt: Sequence[int]) -> tuple[int, list[LayerKV]]:
        """The longest stored prefix of ``prompt`` that leaves at least one token to compute (the
        prefill needs the last token's logits): its length and per-layer KV (empty when none)."""
        if not self.enabled:
            return 0, []
        chain = self._chain(prompt, len(prompt) - 1)
        if not chain:
            return 0, []
        self._touch(chain)
        layers = [
            (
                torch.cat([e.layers[i][0] for e in chain], dim=1),
                torch.cat([e.layers[i][1] for e in chain], dim=1),
            )
            for i in range(len(chain[0].layers))
        ]
        return len(chain) * self.block_tokens, layers

    def store(self, prompt: Sequence[int], layers: Sequence[LayerKV]) -> None:
        """Stores the prompt's whole blocks. ``layers`` holds each layer's KV of the prompt,
        ``[kv_heads, >= len(prompt) rounded down to blocks, head_dim]``, starting at its first
        token; the stored blocks are copies, so ``layers`` may be a view of a larger buffer."""
        if not self.enabled:
            return
        size = self.block_tokens
        chain: list[_Entry] = []
        parent = 0
        # Never more blocks than the cache can hold (a longer prompt keeps its first blocks).
        for index, block in enumerate(self._blocks(prompt, min(len(prompt), self.capacity_tokens))):
            entry = self._by_key.get((parent, block))
            if entry is None:
                start = index * size
                entry = _Entry(
                    next(self._ids),
                    (parent, block),
                    [
                        (k[:, start : start + size].clone(), v[:, start : start + size].clone())
                        for k, v in layers
                    ],
                )
                parent_entry = chain[-1] if chain else None
                if parent_entry is not None:
                    parent_entry.children.add(entry.id)
                self._by_key[entry.key] = entry
                self._lru[entry.id] = entry
            chain.append(entry)
            parent = entry.id
        self._touch(chain)
        self._evict(keep={e.id for e in chain})

    def _evict(self, keep: set[int]) -> None:
        while self.tokens > self.capacity_tokens:
            victim = next((e for e in self._lru.values() if e.id not in keep), None)
            if victim is None:  # only the chain just stored is left: trim it from its end
                victim = next(reversed(self._lru.values()))
                for entry in self._lru.values():
                    if not entry.children:
                        victim = entry
                        break
            self._drop(victim)

    def _drop(self, entry: _Entry) -> None:
        for child_id in list(entry.children):
            child = self._lru.get(child_id)
            if child is not None:
                self._drop(child)
        self._lru.pop(entry.id, None)
        self._by_key.pop(entry.key, None)
        parent = self._lru.get(entry.key[0])
        if parent is not None:
            parent.children.discard(entry.id)

    def clear(self) -> None:
        self._by_key.clear()
        self._lru.clear()
