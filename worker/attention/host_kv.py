"""The host tier's memory (``--kv-offload-bytes``): slots mirroring the KV pool's blocks, and the
copies between them, applied in queue order before each forward (on CUDA on a side stream:
host_copies.py). Design: docs/worker.md.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from worker.attention.host_copies import Copy, SideCopies, Streams, cuda_streams
from worker.attention.kv_pool import KVPool


class HostKV:
    """``slots`` host blocks for each tensor of ``pool`` that holds blocks (keys, values, an
    8-bit cache's scales), pinned on CUDA; never zeroed (a slot is read only once written). On
    CUDA (or given ``streams``) the copies run on a side stream (:class:`SideCopies`)."""

    def __init__(self, pool: KVPool, slots: int, streams: Streams | None = None):
        where = pool.keys[0].device if pool.layers else torch.device("cpu")
        pinned = where.type == "cuda"
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
        if pinned and streams is None:
            streams = cuda_streams(where)
        self.side = SideCopies(self.pairs, streams) if streams is not None else None

    def apply(self, copies: Sequence[Copy]) -> None:
        """Runs ``copies`` in order: each run of one direction as one gather per tensor (the last copy
        to a destination within a run wins, as running them one by one would); on a side stream
        when there is one, without waiting for them."""
        if self.side is not None:
            self.side.apply(copies)
            return
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
