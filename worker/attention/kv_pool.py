"""The paged KV cache's memory: one preallocated pool of blocks per layer, and how big it is.

Design notes: docs/worker.md.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVShape:
    """What one token costs in the pool: per layer, ``kv_heads`` keys and values of ``head_dim``."""

    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.kv_heads * self.head_dim * element


def kv_shape(config: Any, dtype: torch.dtype) -> KVShape:
    """The KV layout of a transformers model config (the text config of a multimodal one)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return KVShape(int(text.num_hidden_layers), kv_heads, int(head_dim), dtype)


def pool_blocks(
    shape: KVShape,
    block_size: int,
    device: torch.device,
    *,
    tokens: int | None,
    cpu_bytes: int,
    gpu_memory_fraction: float,
) -> int:
    """How many blocks the pool gets (at least one).

    ``tokens`` (``--max-batch-tokens``) wins when given; else on CUDA
    ``gpu_memory_fraction`` of the device memory free now (call it after the
    model is loaded and warmed up), else ``cpu_bytes``.
    """
    block_bytes = shape.bytes_per_token * block_size
    if tokens is not None:
        return max(1, -(-tokens // block_size))
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        budget = int(free * gpu_memory_fraction)
        source = f"{gpu_memory_fraction:.2f} of {free / 2**30:.1f} GiB free on {device}"
    else:
        budget = cpu_bytes
        source = f"--kv-cache-bytes {cpu_bytes}"
    blocks = max(1, budget // block_bytes)
    log.info(
        "KV cache: %d blocks of %d tokens (%d tokens, %.2f GiB; %s)",
        blocks,
        block_size,
        blocks * block_size,
        blocks * block_bytes / 2**30,
        source,
    )
    return blocks


class KVPool:
    """Per-layer key and value blocks, ``[num_blocks, block_size, kv_heads, head_dim]`` each."""

    def __init__(self, shape: KVShape, num_blocks: int, block_size: int, device: torch.device):
        self.shape = shape
        self.num_blocks = num_blocks
        self.block_size = block_size
        dims = (num_blocks, block_size, shape.kv_heads, shape.head_dim)
        self.keys = [torch.zeros(dims, dtype=shape.dtype, device=device) for _ in range(shape.num_layers)]
        self.values = [torch.zeros(dims, dtype=shape.dtype, device=device) for _ in range(shape.num_layers)]

    @property
    def bytes(self) -> int:
        return self.num_blocks * self.block_size * self.shape.bytes_per_token
