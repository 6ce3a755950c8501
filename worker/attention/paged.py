"""The attention function transformers calls for every layer: new keys and values into the pool,
attention over each sequence's blocks.

Design notes: docs/worker.md.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from worker.attention.installed import Installed
from worker.attention.kv_pool import KVPool, LayerCache
from worker.attention.prompt_batch import PromptGroup, attend_prompts, group_prompts
from worker.attention.variants import PLAIN, LayerVariant, attend, layer_variant, window_mask

NAME = "sluice_paged"


@dataclass
class Chunk:
    """Several query tokens of one sequence: flat tokens ``[start, start + count)``, the last
    ``count`` of the sequence's ``context`` tokens (whose KV is in ``blocks``)."""

    start: int
    count: int
    context: int
    blocks: torch.Tensor  # long [ceil(context / block_size)]
    # Position spans ``[start, end)`` whose tokens also see each other's later tokens (a Gemma 3
    # image's placeholders, one bidirectional block); the chunk holds each span's end.
    spans: tuple[tuple[int, int], ...] = ()
    # The spans are bidirectional on sliding-window layers only (Gemma 4's "vision" mode).
    windowed_spans: bool = False
    _masks: dict[tuple[int | None, int], torch.Tensor | None] = field(default_factory=dict)

    def mask(self, window: int | None, group: int) -> torch.Tensor | None:
        """:func:`chunk_mask` for a layer with this window and ``group`` query heads per kv head
        (both may differ between layers), built once per step."""
        key = (window, group)
        if key not in self._masks:
            spans = () if self.windowed_spans and window is None else self.spans
            self._masks[key] = chunk_mask(self.count, self.context, group, self.blocks.device, window, spans)
        return self._masks[key]


@dataclass
class PagedStep:
    """Everything a forward's attention needs besides the model: built once per step by the runner."""

    pool: KVPool
    slots: torch.Tensor  # long [T]: pool slot (block * block_size + offset) of each token
    # Decode rows (one query token each): their flat token indexes (None: every token, in order),
    # block tables [rows, width], context lengths [rows] (0 = a padding row), and the padded
    # context width their gather uses with its mask [rows, 1, 1, width * block_size].
    decode_tokens: torch.Tensor | None = None
    decode_tables: torch.Tensor | None = None
    decode_lengths: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None
    chunks: list[Chunk] = field(default_factory=list)
    # Set on CUDA when the Triton decode kernel serves the decode rows (no gather, no mask).
    decode_kernel: Any = None
    # Set in batch-invariant mode: every token is computed by :func:`_invariant` (nothing else is set).
    invariant: InvariantRows | None = None
    _window_masks: dict[int, torch.Tensor] = field(default_factory=dict)
    _prompts: dict[int | None, tuple[list[PromptGroup], list[Chunk]]] = field(default_factory=dict)

    def split_chunks(self, window: int | None) -> tuple[list[PromptGroup], list[Chunk]]:
        """For a plain-softmax layer with this window, the chunks that start their sequence and
        that the window does not narrow, grouped (:mod:`worker.attention.prompt_batch`), and the
        other chunks (built once per step and window)."""
        if window not in self._prompts:
            whole: list[Chunk] = []
            rest: list[Chunk] = []
            for chunk in self.chunks:
                starts = chunk.context == chunk.count and not chunk.spans
                narrowed = window is not None and window < chunk.context
                (whole if starts and not narrowed else rest).append(chunk)
            groups = group_prompts([(c.start, c.count) for c in whole], self.slots.device) if whole else []
            self._prompts[window] = (groups, rest)
        return self._prompts[window]

    def decode_visible(self, window: int | None) -> torch.Tensor:
        """The decode rows' gather mask for a layer with this window (built once per step)."""
        assert self.decode_mask is not None and self.decode_lengths is not None
        width = self.decode_mask.shape[-1]
        if window is None or window >= width:
            return self.decode_mask
        if window not in self._window_masks:
            self._window_masks[window] = decode_mask(self.decode_lengths, width, window)
        return self._window_masks[window]


@dataclass
class InvariantTile:
    """Tokens ``[first, last)`` of a batch-invariant step, gathered together: each reads ``width``
    key slots (its context up to itself, padded) from the flat ``blocks``; ``masked`` marks the
    slots past a token's own context."""

    first: int
    last: int
    width: int
    blocks: torch.Tensor  # long [(last - first) * width / block_size]
    masked: torch.Tensor  # bool [last - first, 1, 1, width]
    lengths: torch.Tensor  # long [last - first]: each token's context, itself included
    _windowed: dict[int, torch.Tensor] = field(default_factory=dict)

    def masked_for(self, window: int | None) -> torch.Tensor:
        """``masked`` with, for a layer with this window, the keys before each token's window."""
        if window is None or window >= self.width:
            return self.masked
        if window not in self._windowed:
            self._windowed[window] = ~decode_mask(self.lengths, self.width, window)
        return self._windowed[window]


@dataclass
class InvariantRows:
    """Every query token of a batch-invariant step (see docs/worker.md), as gather tiles
    planned once per step by :func:`invariant_rows` (every layer reads the same plan)."""

    tiles: list[InvariantTile]


# Keys are padded to a multiple of this many tokens, so a softmax or a dot product over a row sees its
# real entries in the same vector lanes and order whatever the step's longest row.
INVARIANT_PAD_TOKENS = 64
# Tokens gathered at once are bounded by this many bytes of gathered keys (and as many of values).
INVARIANT_TILE_BYTES = 16 << 20


def invariant_blocks(tokens: int, block_size: int) -> int:
    """Blocks a batch-invariant gather takes for ``tokens`` keys: padded to whole multiples of
    :data:`INVARIANT_PAD_TOKENS` tokens (or of one block, if blocks are larger)."""
    pad = max(1, INVARIANT_PAD_TOKENS // block_size)
    needed = (tokens + block_size - 1) // block_size
    return (needed + pad - 1) // pad * pad


def invariant_rows(
    tables: torch.Tensor, lengths: torch.Tensor, block_size: int, key_bytes: int, device: torch.device
) -> InvariantRows:
    """The gather plan of a batch-invariant step: token ``t`` attends to the first ``lengths[t]``
    slots (its context up to itself) of the blocks in ``tables[t]`` (on the CPU, padded with a block
    of zeros); ``key_bytes`` is one token's key size in one layer. Tiles hold at most about
    :data:`INVARIANT_TILE_BYTES` of gathered keys; each reads only as far as its longest context,
    padded (the padding only adds masked columns, which change no bit of the result)."""
    tokens = int(lengths.shape[0])
    tile = max(1, INVARIANT_TILE_BYTES // (tables.shape[1] * block_size * key_bytes))
    tiles = []
    for first in range(0, tokens, tile):
        last = min(tokens, first + tile)
        span = lengths[first:last]
        blocks = invariant_blocks(int(span.max()), block_size)
        width = blocks * block_size
        masked = torch.arange(width)[None, :] >= span[:, None]
        tiles.append(
            InvariantTile(
                first,
                last,
                width,
                tables[first:last, :blocks].flatten().to(device),
                masked[:, None, None, :].to(device),
                span.to(device),
            )
        )
    return InvariantRows(tiles)


STEP: Installed[PagedStep] = Installed()  # the step of the forward running in this thread


def paged_step(step: PagedStep) -> contextlib.AbstractContextManager[None]:
    """Installs ``step`` for the forward run inside, in this thread (:class:`Installed`)."""
    return STEP.using(step)


def register() -> None:
    """Makes ``attn_implementation="sluice_paged"`` known to transformers (idempotent)."""
    AttentionInterface.register(NAME, paged_attention_forward)


def decode_mask(lengths: torch.Tensor, width: int, window: int | None = None) -> torch.Tensor:
    """Bool [rows, 1, 1, width]: which of a row's gathered slots hold its context (within the
    last ``window`` tokens, with a window)."""
    return window_mask(lengths - 1, width, window, lengths.device)[:, None, None, :]


def chunk_mask(
    count: int,
    context: int,
    group: int,
    device: torch.device,
    window: int | None = None,
    spans: tuple[tuple[int, int], ...] = (),
) -> torch.Tensor | None:
    """Bool [group * count, context] for :class:`Chunk`: query ``i`` (position ``context - count +
    i``) sees keys up to itself (and within ``window``), repeated for the ``group`` query heads of a
    kv head; None for a whole prompt with ``group`` 1, no window and no spans (SDPA's own causal
    mask). Within each of ``spans`` every query also sees the later keys (still within ``window``)."""
    if window is not None and window >= context:
        window = None
    if count == context and group == 1 and window is None and not spans:
        return None
    queries = torch.arange(count, device=device) + (context - count)
    if not spans:
        return window_mask(queries, context, window, device).repeat(group, 1)
    visible = window_mask(queries, context, None, device)
    keys = torch.arange(context, device=device)
    for start, end in spans:
        visible |= ((queries >= start) & (queries < end))[:, None] & ((keys >= start) & (keys < end))[None, :]
    if window is not None:
        visible &= keys[None, :] > queries[:, None] - window
    return visible.repeat(group, 1)


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: query [b, heads, q, d], key/value [b, kv_heads, q, d]
    (the new tokens only); returns [b, q, heads, d]."""
    step = STEP.value
    variant = layer_variant(module, kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if step is None:
        if variant is PLAIN:
            return sdpa_attention_forward(
                module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
            )
        return _dense(query, key, value, scale, variant), None
    layer = int(module.layer_idx)  # type: ignore[arg-type]
    batch, heads, length, dim = query.shape
    kv_heads = key.shape[1]
    cache = step.pool.layers[layer]
    tokens = batch * length
    flat_k = key.transpose(1, 2).reshape(tokens, kv_heads, dim)
    flat_v = value.transpose(1, 2).reshape(tokens, kv_heads, dim)
    # A layer reusing an earlier layer's KV gets that layer's new keys and values, already written.
    if step.pool.shape.owns_blocks(layer):
        cache.write(step.slots, flat_k, flat_v)
    flat_q = query.transpose(1, 2).reshape(tokens, heads, dim)

    if step.invariant is not None:
        out = _invariant(step.invariant, flat_q, cache, scale, variant)
        return out.view(batch, length, heads, dim), None
    if not step.chunks and step.decode_tokens is None:  # a decode step: every token is a row
        out = _decode(step, flat_q, cache, scale, variant)
        return out.view(batch, length, heads, dim), None
    out = torch.empty_like(flat_q)
    if step.decode_tables is not None and step.decode_tokens is not None and step.decode_tokens.numel():
        out[step.decode_tokens] = _decode(step, flat_q[step.decode_tokens], cache, scale, variant)
    chunks = step.chunks
    if variant.plain_softmax and chunks:  # whole prompts together, the rest one by one
        groups, chunks = step.split_chunks(variant.window)
        if groups:  # their own keys and values as the pool holds them (an 8-bit cache rounds them)
            stored_k, stored_v = (
                cache.stored(flat_k, query.dtype, True),
                cache.stored(flat_v, query.dtype, False),
            )
        for group in groups:
            attend_prompts(group, flat_q, stored_k, stored_v, scale, out)
    for chunk in chunks:
        out[chunk.start : chunk.start + chunk.count] = _chunk(
            chunk, flat_q[chunk.start : chunk.start + chunk.count], cache, scale, variant
        )
    return out.view(batch, length, heads, dim), None


def _grouped_sinks(variant: LayerVariant, kv_heads: int, count: int) -> torch.Tensor | None:
    """The sinks laid out as the rows of a grouped query ``[kv_heads, group * count]``: [kvh, group
    * count, 1] (row g * count + i is query head kv * group + g)."""
    if variant.sinks is None:
        return None
    return variant.sinks.view(kv_heads, -1, 1).repeat_interleave(count, dim=1)


def _dense(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, variant: LayerVariant
) -> torch.Tensor:
    """A cacheless forward's attention (the prompt scorer), for layers SDPA alone does not serve:
    query [b, heads, q, d], key/value [b, kv_heads, q, d] -> [b, q, heads, d]."""
    batch, heads, count, dim = query.shape
    kv_heads = key.shape[1]
    grouped = query.reshape(batch, kv_heads, heads // kv_heads * count, dim)
    visible = chunk_mask(count, count, heads // kv_heads, query.device, variant.window)
    out = attend(grouped, key, value, visible, scale, variant, _grouped_sinks(variant, kv_heads, count))
    return out.view(batch, heads, count, dim).transpose(1, 2)


def _decode(
    step: PagedStep, query: torch.Tensor, cache: LayerCache, scale: float, variant: LayerVariant
) -> torch.Tensor:
    """query [rows, heads, d] -> [rows, heads, d], one token per row."""
    assert step.decode_tables is not None and step.decode_lengths is not None
    if step.decode_kernel is not None:
        return step.decode_kernel(query, cache, step.decode_tables, step.decode_lengths, scale, variant)
    rows, heads, dim = query.shape
    kv_heads = cache.kv_heads
    pool_k, pool_v = cache.gather(step.decode_tables.flatten(), query.dtype)
    keys = pool_k.view(rows, -1, kv_heads, dim).transpose(1, 2)  # [rows, kvh, L, d]
    values = pool_v.view(rows, -1, kv_heads, dim).transpose(1, 2)
    # The query heads of one kv head become that head's query rows (GQA without copying keys).
    grouped = query.view(rows, kv_heads, heads // kv_heads, dim)
    sinks = None if variant.sinks is None else variant.sinks.view(1, kv_heads, -1, 1)
    out = attend(grouped, keys, values, step.decode_visible(variant.window), scale, variant, sinks)
    return out.reshape(rows, heads, dim)


def _chunk(
    chunk: Chunk, query: torch.Tensor, cache: LayerCache, scale: float, variant: LayerVariant
) -> torch.Tensor:
    """query [count, heads, d] -> [count, heads, d] over the sequence's ``context`` tokens."""
    count, heads, dim = query.shape
    kv_heads = cache.kv_heads
    group = heads // kv_heads
    pool_k, pool_v = cache.gather(chunk.blocks, query.dtype)
    keys = pool_k.flatten(0, 1)[: chunk.context].transpose(0, 1)  # [kvh, ctx, d]
    values = pool_v.flatten(0, 1)[: chunk.context].transpose(0, 1)
    visible = chunk.mask(variant.window_within(chunk.context), group)  # [group * count, ctx] or None
    if variant.plain_softmax:
        # 4-D [1, heads, tokens, d], as CUDA's flash and memory-efficient SDPA kernels take them (3-D
        # inputs get the math kernel and its float32 scores); each kv head serves its query heads.
        queries = query.transpose(0, 1)[None]
        keys, values = (t.repeat_interleave(group, dim=0)[None] for t in (keys, values))
        if visible is None:  # a whole prompt, no window: plain causal
            out = F.scaled_dot_product_attention(queries, keys, values, is_causal=True, scale=scale)
        else:  # the mask's rows repeat per group: every head shares the first group's rows
            mask = visible[:count][None, None]
            out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale)
        return out[0].transpose(0, 1).reshape(count, heads, dim)
    # [kv_heads, group * count, d]: row g * count + i is query head kv * group + g at chunk token i.
    grouped = (
        query.view(count, kv_heads, group, dim).permute(1, 2, 0, 3).reshape(kv_heads, group * count, dim)
    )
    out = attend(grouped, keys, values, visible, scale, variant, _grouped_sinks(variant, kv_heads, count))
    return out.view(kv_heads, group, count, dim).permute(2, 0, 1, 3).reshape(count, heads, dim)


def _invariant(
    rows: InvariantRows, query: torch.Tensor, cache: LayerCache, scale: float, variant: LayerVariant
) -> torch.Tensor:
    """query [T, heads, d] -> [T, heads, d], each token by the same arithmetic whatever its step (an
    8-bit cache's widening is elementwise, so it keeps that)."""
    heads, dim = query.shape[1], query.shape[2]
    kv_heads = cache.kv_heads
    group = heads // kv_heads
    sinks = None if variant.sinks is None else variant.sinks.view(1, kv_heads, group, 1)
    out = torch.empty_like(query)
    for tile in rows.tiles:
        n, width = tile.last - tile.first, tile.width
        # [n * kv_heads, width, d], contiguous: one matrix per (token, kv head).
        pool_k, pool_v = cache.gather(tile.blocks, query.dtype)
        keys = pool_k.view(n, width, kv_heads, dim).transpose(1, 2)
        values = pool_v.view(n, width, kv_heads, dim).transpose(1, 2)
        grouped = query[tile.first : tile.last].reshape(n * kv_heads, group, dim)
        scores = torch.bmm(grouped, keys.reshape(-1, width, dim).transpose(1, 2))
        scores = scores.mul_(scale).view(n, kv_heads, group, width)
        if variant.softcap is not None:
            scores = torch.tanh(scores / variant.softcap).mul_(variant.softcap)
        scores = scores.masked_fill_(tile.masked_for(variant.window), float("-inf"))
        if sinks is None:
            probs = torch.softmax(scores, dim=-1)
        else:
            # The sink logit as one more lane after the padded row, in the softmax's denominator
            # only: the softmax's own pass over each row computes it, where an elementwise op over
            # the tile (variants.softmax_attention's sigmoid) would round a token's entries by
            # whether they fall in the op's vector part or its scalar tail, which the tile's
            # token count decides.
            lanes = torch.cat([scores, sinks.to(scores.dtype).expand(n, kv_heads, group, 1)], dim=-1)
            probs = torch.softmax(lanes, dim=-1)[..., :width]
        probs = probs.to(values.dtype).contiguous().view(n * kv_heads, group, width)
        out[tile.first : tile.last] = torch.bmm(probs, values.reshape(-1, width, dim)).view(n, heads, dim)
    return out
