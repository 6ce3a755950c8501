"""The host tier's memory (``--kv-offload-bytes``): slots mirroring the KV pool's blocks, and the
copies between them, applied in queue order before each forward. Design: docs/worker.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from worker.attention.kv_pool import KVPool


class Copy(Protocol):
    """One queued block copy (worker/engine/host_tier.py): device ``block`` to host ``slot`` when
    ``to_host``, else back."""

    @property
    def to_host(self) -> bool: ...
    @property
    def block(self) -> int: ...
    @property
    def slot(self) -> int: ...


class HostKV:
    """``slots`` host blocks for each tensor of ``pool`` that holds blocks (keys, values, an
    8-bit cache's scales), pinned on CUDA; never zeroed (a slot is read only once written)."""

    def __init__(self, pool: KVPool, slots: int):
        pinned = pool.keys[0].device.type == "cuda" if pool.layers else False
        owned = [layer for i, layer in enumerate(pool.layers) if pool.shape.owns_blocks(i)]
        tensors = [
            t for layer in owned for t in (layer.keys, layer.values, layer.key_scales, layer.value_scales)
        ]
        self.pairs = [
            (device, torch.empty((slots, *device.shape[1:]), dtype=device.dtype, pin_memory=pinned))
            for device in tensors
            if device is not None
        ]
        self.block_bytes = sum(host[0].numel() * host.element_size() for _, host in self.pairs)

    def apply(self, copies: Sequence[Copy]) -> None:
        """Runs ``copies`` in order: each run of one direction as one gather per tensor (the last copy
        to a destination within a run wins, as running them one by one would)."""
        start = 0
        while start < len(copies):
            end = start
            while end < len(copies) and copies[end].to_host == copies[start].to_host:
                end += 1
            self._run(copies[start:end])
            start = end

    def _run(self, run: Sequence[Copy]) -> None:
        to_host = run[0].to_host
        last = {(c.slot if to_host else c.block): c for c in run}  # destination -> its last copy
        blocks = [c.block for c in last.values()]
        slots = [c.slot for c in last.values()]
        for device, host in self.pairs:
            block_ids = torch.tensor(blocks, dtype=torch.long, device=device.device)
            slot_ids = torch.tensor(slots, dtype=torch.long)
            if to_host:
                host.index_copy_(0, slot_ids, device.index_select(0, block_ids).cpu())
            else:
                moved = host.index_select(0, slot_ids).to(device.device, non_blocking=True)
                device.index_copy_(0, block_ids, moved)
