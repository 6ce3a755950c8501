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
class LayerKV:
    """One attention layer's geometry: ``heads`` query heads over ``kv_heads`` key and value heads
    of ``head_dim``; ``source``: the layer whose blocks it reads (itself, or for a layer that reuses
    an earlier layer's keys and values, as Gemma 4's last layers do, that layer)."""

    heads: int
    kv_heads: int
    head_dim: int
    source: int
    attends: bool = True  # False: a hybrid model's recurrent or MLP-only layer, which holds no KV

    @property
    def group(self) -> int:
        """Query heads per kv head."""
        return self.heads // self.kv_heads

    @property
    def geometry(self) -> tuple[int, int, int]:
        """``(heads, kv_heads, head_dim)``: what a kernel launch for this layer depends on."""
        return (self.heads, self.kv_heads, self.head_dim)


@dataclass(frozen=True)
class KVShape:
    """The pool's layout: per layer its :class:`LayerKV`; ``dtype`` of every block."""

    layers: tuple[LayerKV, ...]
    dtype: torch.dtype

    @classmethod
    def uniform(
        cls, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, group: int = 1
    ) -> KVShape:
        """Every layer alike, each with its own blocks."""
        return cls(tuple(LayerKV(kv_heads * group, kv_heads, head_dim, i) for i in range(num_layers)), dtype)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def geometries(self) -> tuple[tuple[int, int, int], ...]:
        """The distinct :attr:`LayerKV.geometry` of the attention layers, in layer order."""
        return tuple(dict.fromkeys(layer.geometry for layer in self.layers if layer.attends))

    def owns_blocks(self, index: int) -> bool:
        """Whether layer ``index`` writes blocks of its own (False: it reads its source's, or it is
        no attention layer)."""
        layer = self.layers[index]
        return layer.attends and layer.source == index

    @property
    def bytes_per_token(self) -> int:
        """Keys and values of one token over the layers with blocks of their own."""
        element = torch.empty((), dtype=self.dtype).element_size()
        return sum(
            2 * layer.kv_heads * layer.head_dim * element
            for index, layer in enumerate(self.layers)
            if self.owns_blocks(index)
        )


def layer_configs(text: Any) -> list[Any]:
    """Per layer, the config its attention reads: transformers' per-layer view of a heterogeneous
    config (Gemma 4's ``head_dim`` differs between sliding and global layers; reading it on the
    config itself raises), else the config for every layer."""
    layers = int(text.num_hidden_layers)
    if getattr(text, "is_heterogeneous", False):
        return [text.per_layer_config[i] for i in range(layers)]
    return [text] * layers


def kv_sources(text: Any) -> list[int]:
    """Per layer, the layer whose keys and values it attends to: itself, or for the last
    ``num_kv_shared_layers`` layers (Gemma 4, Gemma 3n) the last earlier layer of the same kind
    (``layer_types``) that computes its own, as transformers' ``kv_sharing_modes`` pairs them."""
    layers = int(text.num_hidden_layers)
    shared = int(getattr(text, "num_kv_shared_layers", 0) or 0)
    first_shared = layers - shared
    if not shared:
        return list(range(layers))
    if first_shared <= 0:
        raise ValueError(f"all {layers} layers reuse another layer's KV (num_kv_shared_layers {shared})")
    kinds = list(text.layer_types)
    sources = list(range(first_shared))
    for index in range(first_shared, layers):
        owners = [i for i in range(first_shared) if kinds[i] == kinds[index]]
        if not owners:
            raise ValueError(
                f"layer {index} ({kinds[index]}) reuses KV that no earlier layer of its kind computes"
            )
        sources.append(owners[-1])
    return sources


# Layer kinds (``layer_types``, Nemotron-H's ``layers_block_type``) that hold no keys or values: a
# hybrid model's linear-attention, Mamba and short-convolution layers keep a state instead
# (worker/attention/state_pool.py), and MLP-only layers keep nothing.
NO_KV_LAYERS = frozenset({"linear_attention", "mamba", "conv", "mlp", "moe"})
NO_KV_BLOCKS = 1 << 16  # the block count of a model without attention layers (they cost no memory)


def kv_shape(config: Any, dtype: torch.dtype) -> KVShape:
    """The KV layout of a transformers model config (the text config of a multimodal one): each
    layer's head geometry, where its keys and values live, and whether it has any."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    kinds = getattr(text, "layer_types", None) or getattr(text, "layers_block_type", None) or ()
    attends = [kind not in NO_KV_LAYERS for kind in kinds] or [True] * int(text.num_hidden_layers)
    layers = []
    for index, (layer, source) in enumerate(zip(layer_configs(text), kv_sources(text), strict=True)):
        heads = int(layer.num_attention_heads)
        kv_heads = int(getattr(layer, "num_key_value_heads", None) or heads)
        head_dim = getattr(layer, "head_dim", None) or layer.hidden_size // heads
        layers.append(LayerKV(heads, kv_heads, int(head_dim), source, attends[index]))
    return KVShape(tuple(layers), dtype)


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
    if not block_bytes:  # no layer keeps keys and values (an all-recurrent model): blocks are only counts
        log.info(
            "KV cache: no attention layers; %d blocks of %d tokens as bookkeeping", NO_KV_BLOCKS, block_size
        )
        return NO_KV_BLOCKS
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
    """Per layer key and value blocks, ``[num_blocks, block_size, kv_heads, head_dim]`` with that
    layer's geometry; a layer that reuses another's KV holds that layer's tensors (no memory), a
    layer without attention an empty tensor."""

    def __init__(self, shape: KVShape, num_blocks: int, block_size: int, device: torch.device):
        self.shape = shape
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        for index, layer in enumerate(shape.layers):
            if not layer.attends:  # never read or written: an empty tensor keeps the indexes
                self.keys.append(torch.empty(0, dtype=shape.dtype, device=device))
                self.values.append(self.keys[-1])
            elif shape.owns_blocks(index):
                dims = (num_blocks, block_size, layer.kv_heads, layer.head_dim)
                self.keys.append(torch.zeros(dims, dtype=shape.dtype, device=device))
                self.values.append(torch.zeros(dims, dtype=shape.dtype, device=device))
            else:  # sources come first: their tensors exist already
                self.keys.append(self.keys[layer.source])
                self.values.append(self.values[layer.source])

    @property
    def bytes(self) -> int:
        return self.num_blocks * self.block_size * self.shape.bytes_per_token
