"""An 8-bit KV cache (``--kv-cache-dtype int8|fp8``): keys and values kept as one-byte codes with one
scale per token and kv head, quantized as the attention writes them, widened where it reads them.

Design notes: docs/worker.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.config import KV_CACHE_DTYPES

# One scale per (token, kv head): bfloat16 for float32's range in two bytes. Its rounding only moves
# the quantization grid (codes are computed against the rounded scale), so it costs no accuracy.
SCALE_DTYPE = torch.bfloat16
# The smallest scale: a head vector of zeros (padding, the scratch block) gets codes of zero.
_TINY_SCALE = 1e-30
_FP8 = torch.float8_e4m3fn


@dataclass(frozen=True)
class KVQuant:
    """How a layer's keys and values are stored: ``name`` (``int8``: symmetric integers, ``fp8``:
    float8 e4m3 bits, kept as ``uint8`` since CPU index copies do not take float8), each head
    vector scaled so its largest magnitude is ``limit``."""

    name: str

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

    def head_bytes(self, head_dim: int) -> int:
        """Bytes of one token's key (or value) of one kv head: its codes and its scale."""
        return head_dim * self.element_bytes + torch.empty((), dtype=SCALE_DTYPE).element_size()

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` ``[..., head_dim]`` -> codes ``[..., head_dim]`` and scales ``[...]``, so that
        ``codes * scale`` is ``x`` to within half a step of ``scale``. Elementwise and per row: no
        host synchronisation (a CUDA graph captures it) and no dependence on the batch."""
        wide = x.float()
        amax = wide.abs().amax(dim=-1)
        scale = (amax / self.limit).clamp_min(_TINY_SCALE).to(SCALE_DTYPE)
        scaled = wide / scale.float()[..., None]
        if self.name == "int8":
            return scaled.round_().clamp_(-127, 127).to(torch.int8), scale
        return scaled.clamp_(-self.limit, self.limit).to(_FP8).view(torch.uint8), scale

    def dequantize(self, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``codes`` ``[..., head_dim]`` and their ``scales`` ``[...]`` back to ``dtype``."""
        values = codes.view(_FP8).to(dtype) if self.name == "fp8" else codes.to(dtype)
        return values.mul_(scales.to(dtype)[..., None])

    def round_trip(self, x: torch.Tensor) -> torch.Tensor:
        """What the pool gives back for ``x`` once written (its dtype kept)."""
        return self.dequantize(*self.quantize(x), x.dtype)


def kv_quant(name: str) -> KVQuant | None:
    """The quantization of ``--kv-cache-dtype`` ``name`` (None for ``auto``: the model's dtype)."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown KV cache dtype {name!r}: one of {', '.join(KV_CACHE_DTYPES)}")
    return None if name == "auto" else KVQuant(name)
