"""A mixture-of-experts block sharded over the tensor-parallel ranks: every rank holds every expert's
slice of the intermediate width (gate/up columns, down rows, the down bias on rank 0 only), the
router whole, and the block's output summed over the ranks once.

Design notes: docs/worker.md, "Tensor parallelism"."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

AllReduce = Callable[[torch.Tensor], None]
# The children an MoE block may have besides its experts: its router (replicated).
ROUTERS = ("gate", "router")


def experts_of(block: Any) -> Any | None:
    """The block's experts module when ``block`` is an MoE block (transformers' experts layout:
    3-D ``gate_up_proj`` or ``up_proj`` and ``down_proj`` parameters), else None."""
    experts = getattr(block, "experts", None)
    down = getattr(experts, "down_proj", None)
    return experts if isinstance(down, nn.Parameter) and down.dim() == 3 else None


def extra_parts(block: Any) -> list[str]:
    """What an MoE block holds besides its experts and router (a shared expert, say): not sharded."""
    return [name for name, _ in block.named_children() if name not in ("experts", *ROUTERS)]


def expert_width(experts: Any) -> int:
    """Each expert's intermediate width (``down_proj`` is ``[E, I, H]`` transposed, else ``[E, H, I]``)."""
    down = experts.down_proj
    return int(down.shape[1] if _transposed(experts) else down.shape[2])


def shard_moe(block: Any, rank: int, ranks: int, all_reduce: AllReduce) -> None:
    """Keeps this rank's slice of every expert's intermediate width and sums the block's output
    (the first of a tuple, as gpt-oss's block returns its router scores too) over the ranks."""
    experts = experts_of(block)
    assert experts is not None, "shard_moe takes an MoE block"
    width = expert_width(experts) // ranks
    first = rank * width
    gated = bool(getattr(experts, "has_gate", True))
    up_name = "gate_up_proj" if gated else "up_proj"
    if not gated:
        columns = torch.arange(first, first + width)
    elif getattr(experts, "is_concatenated", True):  # [gate | up]
        full = expert_width(experts)
        columns = torch.cat(
            [torch.arange(first, first + width), torch.arange(full + first, full + first + width)]
        )
    else:  # gate and up interleaved (gpt-oss): a pair per intermediate column
        columns = torch.arange(2 * first, 2 * (first + width))
    out_dim, in_dim = (2, 1) if _transposed(experts) else (1, 2)
    _keep(experts, up_name, out_dim, columns)
    _keep(experts, f"{up_name}_bias", 1, columns)
    _keep(experts, "down_proj", in_dim, torch.arange(first, first + width))
    bias = getattr(experts, "down_proj_bias", None)
    if isinstance(bias, nn.Parameter) and rank != 0:
        bias.data = torch.zeros_like(bias.data)  # the ranks' sum adds it once
    for name in ("intermediate_size", "intermediate_dim"):
        if isinstance(getattr(experts, name, None), int):
            setattr(experts, name, width)
    block.register_forward_hook(_summed(all_reduce))


def _transposed(experts: Any) -> bool:
    return bool(getattr(experts, "is_transposed", False))


def _keep(experts: Any, name: str, dim: int, index: torch.Tensor) -> None:
    """Replaces parameter ``name`` (if the experts have it) by its slices at ``index`` along ``dim``."""
    parameter = getattr(experts, name, None)
    if isinstance(parameter, nn.Parameter):
        kept = parameter.data.index_select(dim, index.to(parameter.device)).contiguous()
        setattr(experts, name, nn.Parameter(kept, requires_grad=False))


def _summed(all_reduce: AllReduce) -> Callable[[nn.Module, Any, Any], Any]:
    """A forward hook replacing a block's output (the first of a tuple) by its sum over the ranks."""

    def hook(module: nn.Module, args: Any, output: Any) -> Any:
        hidden = (output[0] if isinstance(output, tuple) else output).contiguous()
        all_reduce(hidden)
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

    return hook
