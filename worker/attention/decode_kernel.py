"""The Triton decode attention as a step's ``decode_kernel``, and its start-up check on a model's shapes.

Used by the runner for eager decode rows and by the CUDA graphs for captured ones.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from worker.attention import triton_decode
from worker.attention.kv_pool import KVPool, KVShape, LayerCache
from worker.attention.triton_decode import (
    DecodePlan,
    KVScales,
    SplitWorkspace,
    allocate_split_workspace,
    paged_decode_attention,
    paged_decode_reference,
    plan_decode,
)
from worker.attention.variants import PLAIN, LayerVariant

log = logging.getLogger(__name__)

# What the fallback costs, said in every line that reports one.
FALLBACK_COST = (
    "decode attention gathers instead (gather + SDPA: several times slower per decode step) "
    "and decode runs without CUDA graphs"
)


@dataclass(frozen=True)
class DecodeKernel:
    """The Triton decode attention for a fixed number of rows: per head geometry of the model's
    layers (``(heads, kv_heads, head_dim)``, which Gemma 4's sliding and global layers differ in) its
    split plan and the scratch it writes (a captured graph keeps this object, so the scratch lives
    as long as the graph). Each layer's call picks its own by its query's and pool's shapes."""

    parts: dict[tuple[int, int, int], tuple[DecodePlan, SplitWorkspace | None]]

    def __call__(
        self,
        query: torch.Tensor,
        cache: LayerCache,
        tables: torch.Tensor,
        lengths: torch.Tensor,
        scale: float,
        variant: LayerVariant = PLAIN,
    ) -> torch.Tensor:
        plan, workspace = self.parts[(query.shape[1], cache.kv_heads, query.shape[2])]
        return paged_decode_attention(
            query,
            cache.keys,
            cache.values,
            tables,
            lengths,
            scale,
            plan=plan,
            workspace=workspace,
            window=variant.window,
            softcap=variant.softcap,
            sinks=variant.sinks,
            scales=_scales(cache),
        )


def _scales(cache: LayerCache) -> KVScales | None:
    """An 8-bit cache's scales and code kind as the kernel takes them (None: a float cache)."""
    if cache.quant is None:
        return None
    assert cache.key_scales is not None and cache.value_scales is not None
    return KVScales(cache.key_scales, cache.value_scales, cache.quant.name)


def decode_kernel(
    batch: int, shape: KVShape, max_blocks: int, block_size: int, device: torch.device
) -> DecodeKernel:
    """The Triton decode attention for ``batch`` rows of a model of this ``shape`` as a
    :class:`~worker.attention.paged.PagedStep` ``decode_kernel`` (each geometry's split plan fixed
    by the shapes, its scratch allocated once)."""
    parts: dict[tuple[int, int, int], tuple[DecodePlan, SplitWorkspace | None]] = {}
    for heads, kv_heads, head_dim in shape.geometries:
        plan = plan_decode(batch, kv_heads, max_blocks, block_size)
        like = torch.empty((batch, heads, head_dim), dtype=shape.dtype, device=device)
        parts[(heads, kv_heads, head_dim)] = (
            plan,
            allocate_split_workspace(like, plan) if plan.split else None,
        )
    return DecodeKernel(parts)


def kernel_problem(
    shape: KVShape, block_size: int, device: torch.device, softcap: float | None = None
) -> str | None:
    """Why the Triton decode kernel cannot serve decode rows on ``device`` (logged at ERROR with
    what it costs), or None when it runs and agrees with the torch reference on small cases of each
    of this model's layer geometries, plain and with a window, ``softcap`` and sinks."""
    problem: str | None = "triton is not installed"
    if triton_decode.triton_available():
        problem = next(
            (
                found
                for geometry in shape.geometries
                if (found := _check(geometry, shape, block_size, device, softcap)) is not None
            ),
            None,
        )
    if problem is not None:
        log.error("the Triton decode kernel is off (%s): %s", problem, FALLBACK_COST)
    return problem


def kernel_works(shape: KVShape, block_size: int, device: torch.device, softcap: float | None = None) -> bool:
    """Whether the Triton decode kernel runs here and agrees with the reference (:func:`kernel_problem`)."""
    return kernel_problem(shape, block_size, device, softcap) is None


def _check(
    geometry: tuple[int, int, int],
    shape: KVShape,
    block_size: int,
    device: torch.device,
    softcap: float | None,
) -> str | None:
    """:func:`kernel_problem` for the layers of one ``(heads, kv_heads, head_dim)``, over blocks
    stored as the pool stores them (an 8-bit cache's codes and scales)."""
    heads, kv_heads, head_dim = geometry
    dtype = shape.dtype
    try:
        generator = torch.Generator(device=device).manual_seed(0)
        size = block_size
        pool = KVPool(
            KVShape.uniform(1, kv_heads, head_dim, dtype, heads // kv_heads, shape.cache), 8, size, device
        )
        cache = pool.layers[0]
        slots = torch.arange(8 * size, device=device)
        new_k = torch.randn((8 * size, kv_heads, head_dim), generator=generator, device=device)
        new_v = torch.randn(new_k.shape, generator=generator, device=device)
        cache.write(slots, new_k.to(dtype), new_v.to(dtype))
        pool_k, pool_v = cache.gather(torch.arange(8, device=device), dtype)  # as the reference reads them
        query = torch.randn((3, heads, head_dim), generator=generator, device=device).to(dtype)
        tables = torch.tensor([[3, 1, 0], [7, 0, 0], [2, 5, 6]], dtype=torch.int32, device=device)
        lengths = torch.tensor([2 * size + 1, 1, 3 * size], dtype=torch.int32, device=device)
        scale = head_dim**-0.5
        sinks = torch.randn((heads,), generator=generator, device=device)
        pairs = []
        for v in (PLAIN, LayerVariant(size + 3, softcap, sinks)):
            rows = (tables, lengths, scale)
            kernel = DecodeKernel({geometry: (plan_decode(3, kv_heads, 3, size), None)})
            got = kernel(query, cache, *rows, variant=v)
            want = paged_decode_reference(
                query, pool_k, pool_v, *rows, window=v.window, softcap=v.softcap, sinks=v.sinks
            )
            pairs.append((got.float(), want.float()))
    except Exception as error:
        log.error("the Triton decode kernel's start-up check raised", exc_info=True)
        return f"its start-up check raised {type(error).__name__}: {str(error)[:300]}"
    if not all(torch.allclose(got, want, rtol=2e-2, atol=2e-2) for got, want in pairs):
        return "it disagrees with the torch reference on this model's shapes"
    return None
