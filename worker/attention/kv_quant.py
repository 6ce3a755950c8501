"""An 8-bit KV cache (``--kv-cache-dtype int8|fp8``): keys and values kept as one-byte codes with a
scale per token, kv head and group of dims (keys: 4 in int8, the whole head in fp8; values: 32),
quantized as the attention writes them, widened when read.

Design notes: docs/worker.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.config import KV_CACHE_DTYPES

# One scale per (token, kv head, group of dims), in float32 for a float32 model's cache and in
# bfloat16 (float32's range in two bytes) for a half-precision one. Its rounding only moves the
# quantization grid (codes are computed against the rounded scale), but a bfloat16 grid step is up
# to 1/256 coarser than the group's: on the default model in float32 the worst of 88 positions went
# from 0.060 to 0.038 with float32 scales, for 2.56x float32's tokens instead of 3.12x
# (docs/benchmarks.md, "An 8-bit KV cache"); a half-precision cache keeps its capacity.
SCALE_DTYPE = torch.bfloat16
# Dims sharing a scale, per cache dtype: keys, values (None: the whole head row). Values: a head's
# outlier channel then coarsens 31 others, not the whole head. Keys decide the error (their outlier
# channels go through the softmax's exponent). The two dtypes are the two ends of the trade
# (docs/benchmarks.md, "An 8-bit KV cache"): int8 is the accurate one, keys per 4 dims keeping the
# default model's worst position under 0.05 (1.56x a bfloat16 cache's tokens); fp8 is the compact
# one, as vLLM's fp8 cache is, one key scale per head (1.91x bfloat16's tokens): its error is its
# 3 mantissa bits, over 0.05 at every grouping (0.16 per 4 dims, 0.45 per head), so finer groups
# would only make it a less accurate int8 of the same size.
KEY_GROUP_DIMS: dict[str, int | None] = {"int8": 4, "fp8": None}
VALUE_GROUP_DIMS: dict[str, int | None] = {"int8": 32, "fp8": 32}
# The smallest scale: a group of zeros (padding, the scratch block) gets codes of zero.
_TINY_SCALE = 1e-30
_FP8 = torch.float8_e4m3fn


@dataclass(frozen=True)
class KVQuant:
    """How a layer's keys and values are stored: ``name`` (``int8``: symmetric integers, ``fp8``:
    float8 e4m3 bits, kept as ``uint8`` since CPU index copies do not take float8), each group of a
    head row (:meth:`group_dims`, per dtype) scaled so its largest magnitude is ``limit``, the scales
    in ``scale_dtype``."""

    name: str
    scale_dtype: torch.dtype = SCALE_DTYPE

    @property
    def limit(self) -> float:
        return 127.0 if self.name == "int8" else float(torch.finfo(_FP8).max)

    @property
    def code_dtype(self) -> torch.dtype:
        return torch.int8 if self.name == "int8" else torch.uint8

    @property
    def element_bytes(self) -> int:
        """Bytes of one code (the scales are counted per head: :meth:`head_bytes`)."""
        return 1

    def head_bytes(self, head_dim: int, keys: bool) -> int:
        """Bytes of one token's key (``keys``) or value of one kv head: its codes and its scales."""
        scale = torch.empty((), dtype=self.scale_dtype).element_size()
        return head_dim * self.element_bytes + scale * (head_dim // self.group_dims(head_dim, keys))

    def group_dims(self, head_dim: int, keys: bool) -> int:
        """Dims per scale of keys (``keys``) or values of this head dim: this dtype's
        :data:`KEY_GROUP_DIMS` or :data:`VALUE_GROUP_DIMS`, or the whole head where that does not
        divide it or is None (readers take the size off the scales' shape, never from here)."""
        dims = (KEY_GROUP_DIMS if keys else VALUE_GROUP_DIMS)[self.name]
        return dims if dims and head_dim % dims == 0 else head_dim

    def quantize(self, x: torch.Tensor, keys: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` ``[..., head_dim]`` (keys, or values) -> codes ``[..., head_dim]`` and scales
        ``[..., groups]``, so that ``codes * scale`` is ``x`` to within half a step of its group's
        scale. Per row and elementwise: no host synchronisation (a CUDA graph captures it), no
        dependence on the batch."""
        wide = _grouped(x.float(), self.group_dims(x.shape[-1], keys))
        amax = wide.abs().amax(dim=-1)
        scale = (amax / self.limit).clamp_min(_TINY_SCALE).to(self.scale_dtype)
        scaled = (wide / scale.float()[..., None]).flatten(-2)
        if self.name == "int8":
            return scaled.round_().clamp_(-127, 127).to(torch.int8), scale
        return scaled.clamp_(-self.limit, self.limit).to(_FP8).view(torch.uint8), scale

    def dequantize(self, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``codes`` ``[..., head_dim]`` and their ``scales`` ``[..., groups]`` back to ``dtype``
        (the groups' size read off the two shapes)."""
        values = codes.view(_FP8).to(dtype) if self.name == "fp8" else codes.to(dtype)
        grouped = _grouped(values, codes.shape[-1] // scales.shape[-1])
        return grouped.mul_(scales.to(dtype)[..., None]).flatten(-2)

    def round_trip(self, x: torch.Tensor, keys: bool) -> torch.Tensor:
        """What the pool gives back for keys (``keys``) or values ``x`` once written (dtype kept)."""
        return self.dequantize(*self.quantize(x, keys), x.dtype)


def _grouped(x: torch.Tensor, dims: int) -> torch.Tensor:
    """``[..., head_dim]`` viewed as ``[..., groups, dims]``."""
    return x.unflatten(-1, (x.shape[-1] // dims, dims))


def kv_quant(name: str, dtype: torch.dtype | None = None) -> KVQuant | None:
    """The quantization of ``--kv-cache-dtype`` ``name`` for a model in ``dtype`` (None for
    ``auto``: the model's dtype); its scales in float32 for a float32 model (:data:`SCALE_DTYPE`
    otherwise)."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown KV cache dtype {name!r}: one of {', '.join(KV_CACHE_DTYPES)}")
    if name == "auto":
        return None
    return KVQuant(name, torch.float32 if dtype == torch.float32 else SCALE_DTYPE)
