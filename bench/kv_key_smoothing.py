"""A measured, not kept, 8-bit key scheme (docs/benchmarks.md, "An 8-bit KV cache"): one scale per
token and kv head for keys, after dividing them by a static per-channel smoothing vector.

Used by ``bench/bench_kv_cache_dtype.py --key-smoothing calibration|weights`` only; the worker
keeps its groups of 4 key dims (worker/attention/kv_quant.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from worker.attention import kv_quant
from worker.attention.kv_pool import LayerCache
from worker.model.runner import ModelRunner
from worker.model.step_inputs import Work

# A short fixed text for the calibration run, not the text the bench scores.
CALIBRATION = (
    "Once upon a time, a small robot lived in a workshop full of tools. Every morning it swept the "
    "floor, counted the screws and wrote a short report for the engineer who built it. Question: what "
    "is 17 times 3? Answer: 51."
)
FLOOR = 0.05  # no channel's divisor under this share of its head's largest (none is 0)


def pair_max(s: torch.Tensor) -> torch.Tensor:
    """``s`` ``[..., head_dim]`` made equal on each rotary pair (channels ``i`` and ``i + d/2``,
    which HF's ``rotate_half`` rotates into each other): the larger of the two on both."""
    half = s.shape[-1] // 2
    larger = torch.maximum(s[..., :half], s[..., half:])
    return torch.cat([larger, larger], dim=-1)


def smoothing(magnitude: torch.Tensor) -> torch.Tensor:
    """A head's per-channel magnitudes ``[kv_heads, head_dim]`` -> its divisors: pair-maxed, floored
    at :data:`FLOOR` of the head's largest, the largest 1."""
    s = pair_max(magnitude.float())
    top = s.amax(dim=-1, keepdim=True).clamp_min(1e-30)
    return s.clamp_min(FLOOR * top) / top


@torch.inference_mode()
def calibrated(reference: ModelRunner, ids: list[int], block: int) -> list[torch.Tensor | None]:
    """(a) Per attention layer with blocks of its own, the largest ``|k|`` per kv head and channel
    of ``ids`` run through the float pool ``reference`` (post-RoPE, as the pool receives them)."""
    table = list(range(-(-len(ids) // block)))
    reference.execute([Work(ids, 0, table, True)])
    out: list[torch.Tensor | None] = []
    for layer in reference.pool.layers:
        keys = layer.keys
        if keys.numel() == 0:
            out.append(None)
            continue
        rows = keys.view(-1, keys.shape[2], keys.shape[3])[: len(ids)]
        out.append(smoothing(rows.abs().amax(dim=0)))
    return out


@torch.inference_mode()
def from_weights(model: Any, kv_heads: int, head_dim: int) -> list[torch.Tensor | None]:
    """(b) Per decoder layer, the norm of each ``k_proj`` output row (read by a probe, so packed
    weights work; times ``k_norm``'s weight where the layer has one)."""
    out: list[torch.Tensor | None] = []
    for layer in model.model.layers:
        attention = layer.self_attn
        probe = attention.k_proj(torch.eye(model.config.hidden_size))
        bias = getattr(attention.k_proj, "bias", None)
        rows = (probe - (0 if bias is None else bias)).float().norm(dim=0).view(kv_heads, head_dim)
        norm = getattr(attention, "k_norm", None)
        if norm is not None and getattr(norm, "weight", None) is not None:
            rows = rows * norm.weight.float().abs()
        out.append(smoothing(rows))
    return out


@contextmanager
def smoothed_keys(vectors: list[torch.Tensor | None]) -> Iterator[Callable[[ModelRunner], ModelRunner]]:
    """While open, runners built are given one key scale per token and kv head; the callable it
    yields makes one store its keys as ``quantize(k / s)`` and widen them as ``dequantize(...) * s``
    (writes, whole prompts, gathers), ``s`` per layer from ``vectors``."""
    divisors: dict[int, torch.Tensor] = {}
    saved = dict(kv_quant.KEY_GROUP_DIMS)
    write, stored, gather = LayerCache.write, LayerCache.stored, LayerCache.gather

    def of(cache: LayerCache, like: torch.Tensor) -> torch.Tensor:
        return divisors[id(cache.keys)].to(like.dtype)

    def new_write(self: LayerCache, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        write(self, slots, keys / of(self, keys), values)

    def new_stored(self: LayerCache, new: torch.Tensor, dtype: torch.dtype, keys: bool) -> torch.Tensor:
        if not keys:
            return stored(self, new, dtype, keys)
        return stored(self, new / of(self, new), dtype, keys) * of(self, new).to(dtype)

    def new_gather(
        self: LayerCache, blocks: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = gather(self, blocks, dtype)
        return keys * divisors[id(self.keys)].to(dtype), values

    def attach(model: ModelRunner) -> ModelRunner:
        for layer, s in zip(model.pool.layers, vectors, strict=True):
            if s is not None:
                divisors[id(layer.keys)] = s
        return model

    patches: dict[str, Callable[..., Any]] = {"write": new_write, "stored": new_stored, "gather": new_gather}
    kv_quant.KEY_GROUP_DIMS.update(dict.fromkeys(saved))  # None: one scale per head
    for name, patch in patches.items():
        setattr(LayerCache, name, patch)
    try:
        yield attach
    finally:
        kv_quant.KEY_GROUP_DIMS.update(saved)
        for name, original in (("write", write), ("stored", stored), ("gather", gather)):
            setattr(LayerCache, name, original)
