"""The Triton decode attention as a step's ``decode_kernel``, and its start-up check on a model's shapes.

Used by the runner for eager decode rows and by the CUDA graphs for captured ones.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from worker.attention.kv_pool import KVShape
from worker.attention.triton_decode import (
    allocate_split_workspace,
    paged_decode_attention,
    paged_decode_reference,
    plan_decode,
)
from worker.attention.variants import PLAIN, LayerVariant

log = logging.getLogger(__name__)

DecodeKernel = Callable[..., torch.Tensor]


def decode_kernel(
    batch: int, kv_heads: int, max_blocks: int, block_size: int, query_like: torch.Tensor
) -> DecodeKernel:
    """The Triton decode attention for ``batch`` rows as a :class:`~worker.attention.paged.PagedStep`
    ``decode_kernel`` (its split plan fixed by the shapes, its scratch allocated once)."""
    plan = plan_decode(batch, kv_heads, max_blocks, block_size)
    workspace = allocate_split_workspace(query_like, plan) if plan.split else None

    def attend(query, pool_k, pool_v, tables, lengths, scale, variant=PLAIN):  # type: ignore[no-untyped-def]
        return paged_decode_attention(
            query,
            pool_k,
            pool_v,
            tables,
            lengths,
            scale,
            plan=plan,
            workspace=workspace,
            window=variant.window,
            softcap=variant.softcap,
            sinks=variant.sinks,
        )

    return attend


def kernel_works(
    shape: KVShape, group: int, block_size: int, device: torch.device, softcap: float | None = None
) -> bool:
    """Whether the Triton decode kernel runs here and agrees with the torch reference on small
    cases of this model's shapes, plain and with a window, ``softcap`` and sinks (checked once at
    start-up; on failure the gather path is used)."""
    try:
        generator = torch.Generator(device=device).manual_seed(0)
        heads = shape.kv_heads * group
        size = block_size
        pool_k = torch.randn((8, size, shape.kv_heads, shape.head_dim), generator=generator, device=device)
        pool_v = torch.randn(pool_k.shape, generator=generator, device=device)
        query = torch.randn((3, heads, shape.head_dim), generator=generator, device=device)
        pool_k, pool_v, query = (t.to(shape.dtype) for t in (pool_k, pool_v, query))
        tables = torch.tensor([[3, 1, 0], [7, 0, 0], [2, 5, 6]], dtype=torch.int32, device=device)
        lengths = torch.tensor([2 * size + 1, 1, 3 * size], dtype=torch.int32, device=device)
        scale = shape.head_dim**-0.5
        sinks = torch.randn((heads,), generator=generator, device=device)
        variants = [PLAIN, LayerVariant(size + 3, softcap, sinks)]
        pairs = [
            (
                paged_decode_attention(
                    query,
                    pool_k,
                    pool_v,
                    tables,
                    lengths,
                    scale,
                    window=v.window,
                    softcap=v.softcap,
                    sinks=v.sinks,
                ).float(),
                paged_decode_reference(
                    query,
                    pool_k,
                    pool_v,
                    tables,
                    lengths,
                    scale,
                    window=v.window,
                    softcap=v.softcap,
                    sinks=v.sinks,
                ).float(),
            )
            for v in variants
        ]
    except Exception:
        log.exception("the Triton decode kernel failed its start-up check: decode attention gathers instead")
        return False
    if not all(torch.allclose(got, want, rtol=2e-2, atol=2e-2) for got, want in pairs):
        log.error("the Triton decode kernel disagrees with the reference: decode attention gathers instead")
        return False
    return True
