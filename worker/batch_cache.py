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
