"""The KV cache of a batch of sequences of different lengths, for one forward per step.

Rows are left-padded: row ``i`` holds its ``lengths[i]`` tokens in the last
``lengths[i]`` columns of a ``[rows, kv_heads, capacity, head_dim]`` buffer
per layer, so every row writes its next token into the same column. Buffers
are preallocated and written in place (transformers' ``DynamicCache`` would
copy the whole cache with ``torch.cat`` every step); they grow by a margin when
full. The padding columns are hidden by the 4D attention mask the caller
passes (transformers uses a 4D mask as given), and each row's positions come
from its own length, so a row computes exactly what it would compute alone.

Rows join (``append``, copying a prefilled cache's rows, possibly several
times for ``n`` choices) and leave (``keep``) between steps; both rebuild the
buffers once, which is cheap next to a forward pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

GROWTH_COLUMNS = 64


class _BufferLayer(DynamicLayer):
    """One layer's keys and values in preallocated buffers; ``update`` writes in place."""

    def __init__(self) -> None:
        super().__init__()
        self.buffer_k: torch.Tensor | None = None
        self.buffer_v: torch.Tensor | None = None
        self.used = 0

    def set_buffers(self, keys: torch.Tensor | None, values: torch.Tensor | None, used: int) -> None:
        self.buffer_k, self.buffer_v, self.used = keys, values, used
        self.is_initialized = keys is not None
        self._expose()

    def _expose(self) -> None:
        if self.buffer_k is None or self.buffer_v is None:
            self.keys = self.values = None
            return
        self.keys = self.buffer_k[:, :, : self.used]
        self.values = self.buffer_v[:, :, : self.used]
        self.dtype, self.device = self.buffer_k.dtype, self.buffer_k.device

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.used + key_states.shape[-2]
        if self.buffer_k is None or self.buffer_v is None or end > self.buffer_k.shape[-2]:
            self._grow(end, key_states, value_states)
        assert self.buffer_k is not None and self.buffer_v is not None  # for the type checker
        self.buffer_k[:, :, self.used : end] = key_states
        self.buffer_v[:, :, self.used : end] = value_states
        self.used = end
        self._expose()
        assert self.keys is not None and self.values is not None
        return self.keys, self.values

    def _grow(self, needed: int, like_k: torch.Tensor, like_v: torch.Tensor) -> None:
        capacity = needed + GROWTH_COLUMNS
        new_k = like_k.new_zeros((*like_k.shape[:2], capacity, like_k.shape[-1]))
        new_v = like_v.new_zeros((*like_v.shape[:2], capacity, like_v.shape[-1]))
        if self.buffer_k is not None and self.buffer_v is not None and self.used:
            new_k[:, :, : self.used] = self.buffer_k[:, :, : self.used]
            new_v[:, :, : self.used] = self.buffer_v[:, :, : self.used]
        self.buffer_k, self.buffer_v = new_k, new_v
        self.is_initialized = True

    def get_seq_length(self) -> int:
        return self.used


class BatchCache(Cache):
    """Left-padded KV cache of a batch; ``lengths[i]`` is row ``i``'s token count."""

    def __init__(self, num_layers: int):
        super().__init__(layers=[_BufferLayer() for _ in range(num_layers)])
        self.lengths: list[int] = []
        # A prefill's cache only: how many of each row's tokens came from the prefix cache
        # (empty when none did).
        self.prefix_lengths: list[int] = []

    @property
    def width(self) -> int:
        return self._layers()[0].used

    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def allocated_bytes(self) -> int:
        total = 0
        for layer in self._layers():
            for buffer in (layer.buffer_k, layer.buffer_v):
                if buffer is not None:
                    total += buffer.numel() * buffer.element_size()
        return total

    def _layers(self) -> list[_BufferLayer]:
        return self.layers  # type: ignore[return-value]

    def append(self, source: BatchCache, source_rows: Sequence[int]) -> None:
        """Adds copies of ``source``'s rows (in this order) at the end of the batch."""
        if not source_rows:
            return
        new_lengths = [source.lengths[i] for i in source_rows]
        width = max(self.width, source.width)
        index = torch.tensor(list(source_rows), dtype=torch.long)
        for mine, theirs in zip(self._layers(), source._layers(), strict=True):
            assert theirs.buffer_k is not None and theirs.buffer_v is not None
            added_k = theirs.buffer_k[:, :, : theirs.used].index_select(0, index.to(theirs.buffer_k.device))
            added_v = theirs.buffer_v[:, :, : theirs.used].index_select(0, index.to(theirs.buffer_v.device))
            shape = (
                self.rows + len(source_rows),
                added_k.shape[1],
                width + GROWTH_COLUMNS,
                added_k.shape[-1],
            )
            new_k, new_v = added_k.new_zeros(shape), added_v.new_zeros(shape)
            if self.rows and mine.buffer_k is not None and mine.buffer_v is not None:
                # Right-align the old rows at the new width.
                new_k[: self.rows, :, width - mine.used : width] = mine.buffer_k[:, :, : mine.used]
                new_v[: self.rows, :, width - mine.used : width] = mine.buffer_v[:, :, : mine.used]
            new_k[self.rows :, :, width - theirs.used : width] = added_k
            new_v[self.rows :, :, width - theirs.used : width] = added_v
            mine.set_buffers(new_k, new_v, width)
        self.lengths += new_lengths

    def keep(self, rows: Sequence[int]) -> None:
        """Keeps only these rows (in this order), and drops columns no kept row needs."""
        if not rows:
            for layer in self._layers():
                layer.set_buffers(None, None, 0)
            self.lengths = []
            return
        lengths = [self.lengths[i] for i in rows]
        drop = self.width - max(lengths)
        index = torch.tensor(list(rows), dtype=torch.long)
        for layer in self._layers():
            assert layer.buffer_k is not None and layer.buffer_v is not None
            index = index.to(layer.buffer_k.device)
            keys = layer.buffer_k.index_select(0, index)[:, :, drop:]
            values = layer.buffer_v.index_select(0, index)[:, :, drop:]
            layer.set_buffers(keys, values, layer.used - drop)
        self.lengths = lengths

    def decode_inputs(self, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The 4D additive mask [rows, 1, 1, width + 1] and positions [rows, 1] of one decode step."""
        lengths = torch.tensor(self.lengths, dtype=torch.long, device=device)
        columns = torch.arange(self.width + 1, device=device)
        visible = columns[None, :] >= (self.width - lengths)[:, None]
        mask = torch.zeros(visible.shape, dtype=dtype, device=device)
        mask.masked_fill_(~visible, torch.finfo(dtype).min)
        return mask[:, None, None, :], lengths[:, None]

    def advance(self) -> None:
        """Records that every row got one more token (after a decode step)."""
        self.lengths = [n + 1 for n in self.lengths]


def prefill_inputs(
    prompts: Sequence[Sequence[int]], pad_id: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-padded ids [m, W], positions [m, W] and the 4D causal+padding mask [m, 1, W, W]."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(list(prompt), dtype=torch.long)
    starts = (width - lengths)[:, None]
    columns = torch.arange(width)
    positions = (columns[None, :] - starts).clamp(min=0)
    query = columns[:, None]
    key = columns[None, :]
    causal = key <= query
    # Padding queries attend to themselves only, so no softmax row is empty
    # (an empty row would give NaN, which would leak through the padding).
    visible = (causal[None] & (key[None] >= starts[:, :, None])) | (key == query)[None]
    mask = torch.zeros(visible.shape, dtype=dtype)
    mask.masked_fill_(~visible, torch.finfo(dtype).min)
    return ids.to(device), positions.to(device), mask[:, None].to(device)


def suffix_prefill_inputs(
    prompts: Sequence[Sequence[int]],
    prefix_lengths: Sequence[int],
    pad_id: int,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inputs of a prefill whose rows start from cached prefixes (see :func:`from_prefixes`).

    Row ``i`` computes only ``prompts[i][prefix_lengths[i]:]`` (at least one token), left-padded
    to the longest suffix ``S``, at positions ``prefix_lengths[i] + j``. Returns ids [m, S],
    positions [m, S] and the 4D mask [m, 1, S, P + S], where the first ``P`` (longest prefix)
    key columns are the past: row ``i``'s prefix right-aligned in them.
    """
    prefixes = torch.tensor(list(prefix_lengths), dtype=torch.long)
    suffixes = [prompt[n:] for prompt, n in zip(prompts, prefix_lengths, strict=True)]
    if any(not suffix for suffix in suffixes):
        raise ValueError("every row needs at least one token after its cached prefix")
    past = int(prefixes.max())
    ids, positions, own = prefill_inputs(suffixes, pad_id, dtype, torch.device("cpu"))
    positions = positions + prefixes[:, None]
    # Every query may see its row's whole prefix (padding queries too: their outputs are dropped).
    visible = torch.arange(past)[None, :] >= (past - prefixes)[:, None]  # [m, P]
    prefix_mask = torch.zeros(visible.shape, dtype=dtype)
    prefix_mask.masked_fill_(~visible, torch.finfo(dtype).min)
    width = ids.shape[1]
    mask = torch.cat([prefix_mask[:, None, None, :].expand(-1, 1, width, -1), own], dim=-1)
    return ids.to(device), positions.to(device), mask.to(device)


def from_prefixes(
    prefixes: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor]]],
    prefix_lengths: Sequence[int],
    suffix_width: int,
) -> BatchCache:
    """The past of a :func:`suffix_prefill_inputs` forward: row ``i``'s prefix KV (per layer,
    ``[kv_heads, prefix_lengths[i], head_dim]``; an empty list for no prefix) right-aligned in
    ``P`` columns, with room for ``suffix_width`` more so the forward writes in place."""
    rows, past = len(prefix_lengths), max(prefix_lengths)
    like = next(layers for layers in prefixes if layers)
    cache = BatchCache(len(like))
    for index, layer in enumerate(cache._layers()):
        k0, v0 = like[index]
        keys = k0.new_zeros((rows, k0.shape[0], past + suffix_width, k0.shape[-1]))
        values = v0.new_zeros((rows, v0.shape[0], past + suffix_width, v0.shape[-1]))
        for row, (layers, length) in enumerate(zip(prefixes, prefix_lengths, strict=True)):
            if length:
                keys[row, :, past - length : past] = layers[index][0]
                values[row, :, past - length : past] = layers[index][1]
        layer.set_buffers(keys, values, past)
    return cache


def compact(cache: BatchCache, prefix_lengths: Sequence[int], suffix_lengths: Sequence[int]) -> BatchCache:
    """A prefix-started prefill's cache in the usual layout: row ``i``'s prefix columns and suffix
    columns (with the padding between them) become its last ``prefix + suffix`` columns."""
    past = max(prefix_lengths)
    total = cache.width
    suffix_width = total - past
    lengths = [p + s for p, s in zip(prefix_lengths, suffix_lengths, strict=True)]
    width = max(lengths)
    # source[i, t]: the column of row i's token that lands in column t (0 for padding columns,
    # which the mask hides anyway).
    source = torch.zeros((len(lengths), width), dtype=torch.long)
    for row, (p, s) in enumerate(zip(prefix_lengths, suffix_lengths, strict=True)):
        start = width - p - s
        source[row, start : start + p] = torch.arange(past - p, past)
        source[row, start + p :] = torch.arange(past + suffix_width - s, total)
    out = BatchCache(len(cache.layers))
    for mine, theirs in zip(out._layers(), cache._layers(), strict=True):
        assert theirs.buffer_k is not None and theirs.buffer_v is not None
        k, v = theirs.buffer_k[:, :, :total], theirs.buffer_v[:, :, :total]
        index = source.to(k.device)[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[-1])
        mine.set_buffers(k.gather(2, index), v.gather(2, index), width)
    out.lengths = lengths
    return out
