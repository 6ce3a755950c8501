"""Dynamic per-token FP8 activations (compressed-tensors' FP8-dynamic scheme): each row of the
input rounded to float8 e4m3 under its own scale before an fp8 layer's product.
Design notes: docs/worker.md ("Pre-quantized checkpoints")."""

from __future__ import annotations

import torch

from worker.quant.layers import Fp8Linear

_E4M3 = torch.finfo(torch.float8_e4m3fn)


def fp8_per_token(x: torch.Tensor) -> torch.Tensor:
    """``x`` with each row (last dimension) rounded to e4m3 at scale ``max|row| / 448`` and back."""
    scale = x.abs().amax(dim=-1, keepdim=True) / _E4M3.max
    scale = torch.where(scale == 0, torch.full_like(scale, torch.finfo(x.dtype).eps), scale)
    rounded = (x / scale).clamp(_E4M3.min, _E4M3.max).to(torch.float8_e4m3fn)
    return rounded.to(x.dtype) * scale


class Fp8DynamicLinear(Fp8Linear):
    """An :class:`Fp8Linear` whose input rows are quantized per token as the checkpoint prescribes:
    on ``_scaled_mm`` where it serves (which rounds them itself), else simulated before the product
    on the upcast weight."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.on_cuda_kernel and x.dtype == torch.bfloat16:
            return super().forward(x)
        return super().forward(fp8_per_token(x))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8 e4m3 activations per token"
