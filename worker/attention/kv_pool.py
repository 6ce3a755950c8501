"""The paged KV cache's memory: one preallocated pool of blocks per layer, and how big it is.

Design notes: docs/worker.md.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import mmap
from dataclasses import dataclass
from typing import Any

import torch

from worker.attention.kv_quant import KVQuant, kv_quant

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
    """The pool's layout: per layer its :class:`LayerKV`; ``dtype``: what attention computes in
    (the model's), and the blocks' unless ``cache`` (``--kv-cache-dtype``) stores 8-bit codes."""

    layers: tuple[LayerKV, ...]
    dtype: torch.dtype
    cache: str = "auto"

    @classmethod
    def uniform(
        cls,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        group: int = 1,
        cache: str = "auto",
    ) -> KVShape:
        """Every layer alike, each with its own blocks."""
        layers = tuple(LayerKV(kv_heads * group, kv_heads, head_dim, i) for i in range(num_layers))
        return cls(layers, dtype, cache)

    def per_rank(self, ranks: int) -> KVShape:
        """One tensor-parallel rank's share: its query heads and its KV heads (one, replicated, where
        there are fewer KV heads than ranks); the whole shape for one rank."""
        if ranks == 1:
            return self
        layers = tuple(
            dataclasses.replace(layer, heads=layer.heads // ranks, kv_heads=max(1, layer.kv_heads // ranks))
            for layer in self.layers
        )
        return KVShape(layers, self.dtype, self.cache)

    @property
    def quant(self) -> KVQuant | None:
        """How keys and values are stored (None: in :attr:`dtype`)."""
        return kv_quant(self.cache, self.dtype)

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
        """Keys and values of one token over the layers with blocks of their own (an 8-bit
        cache's scales included)."""
        quant = self.quant
        element = torch.empty((), dtype=self.dtype).element_size()
        return sum(
            layer.kv_heads
            * (
                2 * layer.head_dim * element
                if quant is None
                else quant.head_bytes(layer.head_dim, True) + quant.head_bytes(layer.head_dim, False)
            )
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


def kv_shape(config: Any, dtype: torch.dtype, cache: str = "auto") -> KVShape:
    """The KV layout of a transformers model config (the text config of a multimodal one): each
    layer's head geometry, where its keys and values live, and whether it has any; ``cache``: the
    ``--kv-cache-dtype``."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    kinds = getattr(text, "layer_types", None) or getattr(text, "layers_block_type", None) or ()
    attends = [kind not in NO_KV_LAYERS for kind in kinds] or [True] * int(text.num_hidden_layers)
    layers = []
    for index, (layer, source) in enumerate(zip(layer_configs(text), kv_sources(text), strict=True)):
        heads = int(layer.num_attention_heads)
        kv_heads = int(getattr(layer, "num_key_value_heads", None) or heads)
        head_dim = getattr(layer, "head_dim", None) or layer.hidden_size // heads
        layers.append(LayerKV(heads, kv_heads, int(head_dim), source, attends[index]))
    return KVShape(tuple(layers), dtype, cache)


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
        "KV cache: %d blocks of %d tokens (%d tokens, %.2f GiB; %s)%s",
        blocks,
        block_size,
        blocks * block_size,
        blocks * block_bytes / 2**30,
        source,
        _capacity_note(shape),
    )
    return blocks


def _capacity_note(shape: KVShape) -> str:
    """For an 8-bit cache, what it holds against the model's dtype (the start-up log says it)."""
    if shape.quant is None:
        return ""
    plain = KVShape(shape.layers, shape.dtype).bytes_per_token
    dtype = str(shape.dtype).removeprefix("torch.")
    return (
        f"; --kv-cache-dtype {shape.cache}: {shape.bytes_per_token} bytes per token against "
        f"{plain} in {dtype}, {plain / shape.bytes_per_token:.2f}x the tokens"
    )


@dataclass(frozen=True)
class LayerCache:
    """One layer's blocks as attention writes and reads them: ``keys``/``values`` ``[num_blocks,
    block_size, kv_heads, head_dim]`` in the model's dtype, or an 8-bit cache's codes with their
    ``key_scales``/``value_scales`` ``[num_blocks, block_size, kv_heads, groups]`` (``quant``; keys
    have more groups than values)."""

    keys: torch.Tensor
    values: torch.Tensor
    key_scales: torch.Tensor | None = None
    value_scales: torch.Tensor | None = None
    quant: KVQuant | None = None

    @property
    def kv_heads(self) -> int:
        return int(self.keys.shape[2])

    def write(self, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Stores new ``keys``/``values`` ``[T, kv_heads, d]`` at pool ``slots`` ``[T]``."""
        heads, dim = keys.shape[1], keys.shape[2]
        if self.quant is None:
            self.keys.view(-1, heads, dim).index_copy_(0, slots, keys.to(self.keys.dtype))
            self.values.view(-1, heads, dim).index_copy_(0, slots, values.to(self.values.dtype))
            return
        assert self.key_scales is not None and self.value_scales is not None
        for new, codes, scales, are_keys in (
            (keys, self.keys, self.key_scales, True),
            (values, self.values, self.value_scales, False),
        ):
            quantized, scale = self.quant.quantize(new, are_keys)
            codes.view(-1, heads, dim).index_copy_(0, slots, quantized)
            scales.view(-1, heads, scale.shape[-1]).index_copy_(0, slots, scale)

    def stored(self, new: torch.Tensor, dtype: torch.dtype, keys: bool) -> torch.Tensor:
        """What the pool gives back for new keys (``keys``) or values ``[T, kv_heads, d]`` once
        written, in ``dtype`` (a whole prompt attends to its own keys as later steps will read them)."""
        if self.quant is None:
            return new.to(self.keys.dtype).to(dtype)
        return self.quant.round_trip(new.to(dtype), keys)

    def gather(self, blocks: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of ``blocks`` (long ``[n]``), ``[n, block_size, kv_heads, d]`` in ``dtype``
        (index_select, not advanced indexing: about 4x faster on the CPU)."""
        keys, values = self.keys.index_select(0, blocks), self.values.index_select(0, blocks)
        if self.quant is None:
            return keys, values
        assert self.key_scales is not None and self.value_scales is not None
        return (
            self.quant.dequantize(keys, self.key_scales.index_select(0, blocks), dtype),
            self.quant.dequantize(values, self.value_scales.index_select(0, blocks), dtype),
        )


def zeroed(dims: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of zeros; on the CPU in an anonymous memory mapping, whose pages the kernel maps
    zeroed on first touch: a pool costs no time or memory at start, only as its blocks are used
    (``torch.zeros`` would write every byte of a 1 GiB pool, about 0.5 s of CPU per worker)."""
    size = math.prod(dims) * dtype.itemsize
    if device.type != "cpu" or size == 0:
        return torch.zeros(dims, dtype=dtype, device=device)
    private = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # as malloc's: not shared
    return torch.frombuffer(private, dtype=dtype).view(dims)  # the tensor keeps the mapping alive


def _allocate(
    dims: tuple[int, int, int, int], dtype: torch.dtype, quant: KVQuant | None, device: torch.device
) -> LayerCache:
    """One layer's blocks, zeros (padding slots that a mask hides must hold finite values)."""
    keys = zeroed(dims, dtype, device)
    values = zeroed(dims, dtype, device)
    if quant is None:
        return LayerCache(keys, values)
    key_scales, value_scales = (
        zeroed((*dims[:3], dims[3] // quant.group_dims(dims[3], keys)), quant.scale_dtype, device)
        for keys in (True, False)
    )
    return LayerCache(keys, values, key_scales, value_scales, quant)


class KVPool:
    """Per layer key and value blocks, ``[num_blocks, block_size, kv_heads, head_dim]`` with that
    layer's geometry (an 8-bit cache's codes, with their scales); a layer that reuses another's KV
    holds that layer's tensors (no memory), a layer without attention empty tensors."""

    def __init__(self, shape: KVShape, num_blocks: int, block_size: int, device: torch.device):
        self.shape = shape
        self.num_blocks = num_blocks
        self.block_size = block_size
        quant = shape.quant
        dtype = shape.dtype if quant is None else quant.code_dtype
        self.layers: list[LayerCache] = []
        for index, layer in enumerate(shape.layers):
            if not layer.attends:  # never read or written: empty tensors keep the indexes
                empty = torch.empty((0, 0, 0, 0), dtype=dtype, device=device)
                self.layers.append(LayerCache(empty, empty))
            elif shape.owns_blocks(index):
                dims = (num_blocks, block_size, layer.kv_heads, layer.head_dim)
                self.layers.append(_allocate(dims, dtype, quant, device))
            else:  # sources come first: their tensors exist already
                self.layers.append(self.layers[layer.source])

    @property
    def keys(self) -> list[torch.Tensor]:
        """Each layer's key blocks (an 8-bit cache's codes)."""
        return [layer.keys for layer in self.layers]

    @property
    def values(self) -> list[torch.Tensor]:
        """Each layer's value blocks (an 8-bit cache's codes)."""
        return [layer.values for layer in self.layers]

    @property
    def bytes(self) -> int:
        return self.num_blocks * self.block_size * self.shape.bytes_per_token
