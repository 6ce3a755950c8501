"""GPTQ act-order (``desc_act``) served on the int4 layers: the input features permuted once at load so
each quantization group is contiguous, and each input row gathered in that order per product.
Design notes: docs/worker.md ("Pre-quantized checkpoints")."""

from __future__ import annotations

import torch

from worker.quant.checkpoint_formats import UnsupportedCheckpoint
from worker.quant.layers import Int4Linear


def group_order(g_idx: torch.Tensor, group: int, name: str) -> torch.Tensor | None:
    """The input order that makes ``g_idx`` (each input feature's group) contiguous, None where it
    already is; refused where a group does not hold exactly ``group`` features. A group of -1: an
    input this layer does not read (another tensor-parallel rank's groups), left out of the order."""
    g_idx = g_idx.to(torch.int64)
    held = int((g_idx >= 0).sum())
    plain = torch.arange(held, device=g_idx.device) // group
    if torch.equal(g_idx, plain):
        return None
    order = torch.argsort(g_idx, stable=True)[g_idx.numel() - held :]
    if not torch.equal(g_idx[order], plain):
        raise UnsupportedCheckpoint(f"{name}.g_idx: groups of other than {group} input features")
    return order


class ActOrderInt4Linear(Int4Linear):
    """An :class:`Int4Linear` over the input features in ``order`` (its weight's columns were put in
    that order at load): ``y = x[..., order] W[:, order]^T``, the same product as the checkpoint's."""

    order: torch.Tensor

    def __init__(
        self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int, order: torch.Tensor
    ):
        super().__init__(q[:, order], scale, zero, group=group, batch_copy=False)
        self.register_buffer("order", order.to(torch.int32))  # index_select takes int32: half the bytes
        self.inputs = int(q.shape[1])  # the inputs it reads (more than it holds: a rank's groups)

    def dequantized(self) -> torch.Tensor:
        """The weight in the checkpoint's own column order (zeros for inputs it does not hold)."""
        weight = super().dequantized()
        whole = weight.new_zeros(self.out_features, self.inputs)
        return whole.index_copy_(1, self.order.long(), weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.index_select(-1, self.order))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, act-order (inputs permuted)"
