"""Dynamic FP8 activations (compressed-tensors' FP8-dynamic and FP8-block schemes): each row of the
input, or each group of its columns, rounded to float8 e4m3 under its own scale before the product.
Design notes: docs/worker.md ("Pre-quantized checkpoints")."""

from __future__ import annotations

import torch

from worker.quant.fp8_blocks import Fp8BlockLinear
from worker.quant.layers import Fp8Linear

_E4M3 = torch.finfo(torch.float8_e4m3fn)


def fp8_per_token(x: torch.Tensor, group: int = 0, amax: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` with each row (last dimension) rounded to e4m3 at scale ``max|row| / 448`` and back;
    with ``group``, each run of ``group`` columns of a row under its own scale; ``amax`` (rows'
    shape, last dimension 1): the rows' largest magnitudes, given (a row-parallel shard's whole row)."""
    if group and x.shape[-1] % group == 0 and x.shape[-1] != group:
        return fp8_per_token(x.unflatten(-1, (-1, group))).flatten(-2)
    scale = (x.abs().amax(dim=-1, keepdim=True) if amax is None else amax) / _E4M3.max
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


class Fp8BlockDynamicLinear(Fp8BlockLinear):
    """An :class:`Fp8BlockLinear` whose inputs are rounded to e4m3 per group of ``group`` columns
    (compressed-tensors' FP8-block scheme: its dynamic group activations; 0: per token), then
    multiplied by the upcast weight."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], group: int):
        super().__init__(qweight, scale, block)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(fp8_per_token(x, self.group))

    def extra_repr(self) -> str:
        per = f"{self.group} columns" if self.group else "token"
        return f"{super().extra_repr()}, fp8 e4m3 activations per {per}"
