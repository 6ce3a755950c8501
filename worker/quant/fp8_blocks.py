"""Fine-grained (block-wise) FP8 weights, ``quant_method: fp8`` with ``weight_block_size`` (the
Qwen3-FP8 releases): e4m3 weights under one scale per block, upcast per product.
Design notes: docs/worker.md ("Pre-quantized checkpoints")."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from worker.quant.checkpoint_formats import UnsupportedCheckpoint
from worker.quant.layers import Fp8Linear


class Fp8BlockLinear(Fp8Linear):
    """``y = x W^T + b`` with ``W = qweight * scale`` expanded over ``block`` (rows, columns) tiles:
    ``scale`` [ceil(out / rows), ceil(in / columns)], the checkpoint's ``weight_scale_inv``."""

    kernel_kind = "fp8-block"  # worker/quant/cuda_kernels.py: no kernel, said at start-up

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]):
        torch.nn.Module.__init__(self)
        self.out_features, self.in_features = qweight.shape
        self.block = block
        self.on_cuda_kernel = False  # block scales: upcast per product (no block-scaled kernel yet)
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale.float().contiguous())
        self.register_buffer("bias", None)

    def _scales(self) -> torch.Tensor:
        """One scale per weight element, [out, in] (the blocks' scales repeated over their tiles)."""
        rows, columns = self.block
        tiles = self.scale.repeat_interleave(rows, dim=0).repeat_interleave(columns, dim=1)
        return tiles[: self.out_features, : self.in_features]

    def dequantized(self) -> torch.Tensor:
        return self.qweight.float() * self._scales()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.qweight.to(x.dtype) * self._scales().to(x.dtype)
        return F.linear(x, weight, None if self.bias is None else self.bias.to(x.dtype))

    def extra_repr(self) -> str:
        rows, columns = self.block
        shape = f"in_features={self.in_features}, out_features={self.out_features}"
        return f"{shape}, fp8 e4m3 {rows}x{columns} blocks"


def fp8_block_layer(parts: dict[str, torch.Tensor], block: tuple[int, int], name: str) -> Fp8BlockLinear:
    """The layer of a block-wise FP8 checkpoint's ``weight`` and ``weight_scale_inv``; a scale grid
    that does not tile the weight in ``block`` is refused."""
    weight, scale = parts["weight"], parts["weight_scale_inv"]
    if weight.dtype != torch.float8_e4m3fn:
        raise UnsupportedCheckpoint(f"{name}.weight is {weight.dtype}, not float8_e4m3fn")
    grid = tuple(-(-size // step) for size, step in zip(weight.shape, block, strict=True))
    if tuple(scale.shape) != grid:
        raise UnsupportedCheckpoint(
            f"{name}.weight_scale_inv has shape {tuple(scale.shape)}, not the {grid} blocks of {block}"
        )
    return Fp8BlockLinear(weight, scale, block)
