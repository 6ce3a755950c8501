"""The attention function transformers calls for every layer: new keys and values into the pool,
attention over each sequence's blocks.

The worker loads models with ``attn_implementation="sluice_paged"``
(:func:`register`), so any transformers model whose attention goes through
the attention interface (Llama, Qwen, Mistral, Gemma, Phi, ...) runs over the
paged pool with no model code of ours. The runner describes one forward with
a :class:`PagedStep` and installs it with :func:`paged_step` around the call;
the function finds its layer's pool by ``module.layer_idx``.

A forward's tokens are a flat list (``[1, T]``, or ``[B, 1]`` for a decode
step): token ``t`` belongs to one sequence, and its key and value go to pool
slot ``slots[t]``. Then two kinds of work:

- **decode rows**, one query token each: gather the rows' blocks into one
  padded ``[rows, kv_heads, L, head_dim]`` batch and run one SDPA with a
  length mask (on CUDA, the Triton kernel in ``triton_decode.py`` reads the
  pool through the block tables instead, with no gather);
- **chunks** of several tokens of one sequence (a prompt, or part of one):
  gather that sequence's context and run SDPA with a causal mask offset by
  the tokens before the chunk.

Query heads share key/value heads (GQA) by folding the group into the query
length, so SDPA never copies keys per query head. Masks are built once per
forward (:class:`PagedStep`), not per layer. With no step installed (the
prompt scorer's cacheless forward) the function is transformers' own SDPA.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from worker.kv_pool import KVPool

NAME = "sluice_paged"


@dataclass
class Chunk:
    """Several query tokens of one sequence: flat tokens ``[start, start + count)``, the last
    ``count`` of the sequence's ``context`` tokens (whose KV is in ``blocks``)."""

    start: int
    count: int
    context: int
    blocks: torch.Tensor  # long [ceil(context / block_size)]
    mask: torch.Tensor | None  # :func:`chunk_mask`


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


_current: PagedStep | None = None


@contextlib.contextmanager
def paged_step(step: PagedStep) -> Iterator[None]:
    """Installs ``step`` for the forward run inside (the engine thread runs one forward at a time)."""
    global _current
    previous, _current = _current, step
    try:
        yield
    finally:
        _current = previous


def register() -> None:
    """Makes ``attn_implementation="sluice_paged"`` known to transformers (idempotent)."""
    AttentionInterface.register(NAME, paged_attention_forward)


def decode_mask(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """Bool [rows, 1, 1, width]: which of a row's gathered slots hold its context."""
    return (torch.arange(width, device=lengths.device)[None, :] < lengths[:, None])[:, None, None, :]


def chunk_mask(count: int, context: int, group: int, device: torch.device) -> torch.Tensor | None:
    """Bool [group * count, context] for :class:`Chunk`: query ``i`` (position ``context - count +
    i``) sees keys up to itself, repeated for the ``group`` query heads of a kv head; None for a
    whole prompt with ``group`` 1 (SDPA's own causal mask)."""
    if count == context and group == 1:
        return None
    keys = torch.arange(context, device=device)
    queries = torch.arange(count, device=device)
    return (keys[None, :] <= (queries[:, None] + (context - count))).repeat(group, 1)


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
    step = _current
    if step is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if getattr(module, "sliding_window", None) or kwargs.get("sliding_window"):
        raise NotImplementedError("sliding-window attention is not supported by the paged KV cache yet")
    layer = int(module.layer_idx)  # type: ignore[arg-type]
    batch, heads, length, dim = query.shape
    kv_heads = key.shape[1]
    scale = scaling if scaling is not None else dim**-0.5
    pool_k, pool_v = step.pool.keys[layer], step.pool.values[layer]
    tokens = batch * length
    flat_k = key.transpose(1, 2).reshape(tokens, kv_heads, dim).to(pool_k.dtype)
    flat_v = value.transpose(1, 2).reshape(tokens, kv_heads, dim).to(pool_v.dtype)
    pool_k.view(-1, kv_heads, dim).index_copy_(0, step.slots, flat_k)
    pool_v.view(-1, kv_heads, dim).index_copy_(0, step.slots, flat_v)
    flat_q = query.transpose(1, 2).reshape(tokens, heads, dim)

    if not step.chunks and step.decode_tokens is None:  # a decode step: every token is a row
        out = _decode(step, flat_q, pool_k, pool_v, scale)
        return out.view(batch, length, heads, dim), None
    out = torch.empty_like(flat_q)
    if step.decode_tables is not None and step.decode_tokens is not None and step.decode_tokens.numel():
        out[step.decode_tokens] = _decode(step, flat_q[step.decode_tokens], pool_k, pool_v, scale)
    for chunk in step.chunks:
        out[chunk.start : chunk.start + chunk.count] = _chunk(
            chunk, flat_q[chunk.start : chunk.start + chunk.count], pool_k, pool_v, scale
        )
    return out.view(batch, length, heads, dim), None


def _decode(
    step: PagedStep, query: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor, scale: float
) -> torch.Tensor:
    """query [rows, heads, d] -> [rows, heads, d], one token per row."""
    assert step.decode_tables is not None and step.decode_lengths is not None
    if step.decode_kernel is not None:
        return step.decode_kernel(query, pool_k, pool_v, step.decode_tables, step.decode_lengths, scale)
    assert step.decode_mask is not None
    rows, heads, dim = query.shape
    kv_heads = pool_k.shape[2]
    # index_select over the flat table, not advanced indexing: about 4x faster on the CPU.
    flat = step.decode_tables.flatten()
    keys = pool_k.index_select(0, flat).view(rows, -1, kv_heads, dim).transpose(1, 2)  # [rows, kvh, L, d]
    values = pool_v.index_select(0, flat).view(rows, -1, kv_heads, dim).transpose(1, 2)
    # The query heads of one kv head become that head's query rows (GQA without copying keys).
    grouped = query.view(rows, kv_heads, heads // kv_heads, dim)
    out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=step.decode_mask, scale=scale)
    return out.reshape(rows, heads, dim)


def _chunk(
    chunk: Chunk, query: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor, scale: float
) -> torch.Tensor:
    """query [count, heads, d] -> [count, heads, d] over the sequence's ``context`` tokens."""
    count, heads, dim = query.shape
    kv_heads = pool_k.shape[2]
    group = heads // kv_heads
    keys = (
        pool_k.index_select(0, chunk.blocks).flatten(0, 1)[: chunk.context].transpose(0, 1)
    )  # [kvh, ctx, d]
    values = pool_v.index_select(0, chunk.blocks).flatten(0, 1)[: chunk.context].transpose(0, 1)
    # [kv_heads, group * count, d]: row g * count + i is query head kv * group + g at chunk token i.
    grouped = (
        query.view(count, kv_heads, group, dim).permute(1, 2, 0, 3).reshape(kv_heads, group * count, dim)
    )
    if chunk.mask is None:  # a whole prompt with one query head per kv head: plain causal
        out = F.scaled_dot_product_attention(grouped, keys, values, is_causal=True, scale=scale)
    else:
        out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=chunk.mask, scale=scale)
    return out.view(kv_heads, group, count, dim).permute(2, 0, 1, 3).reshape(count, heads, dim)
