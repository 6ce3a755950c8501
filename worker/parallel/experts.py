"""A mixture-of-experts block sharded over the tensor-parallel ranks: every rank holds every expert's
slice of the intermediate width (gate/up columns, down rows, the down bias on rank 0 only) and of a
shared expert's, the router (and the shared expert's gate) whole, the block's output summed once.

Design notes: docs/worker.md, "Tensor parallelism"."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

AllReduce = Callable[[torch.Tensor], None]
# The children an MoE block may have besides its experts: its router (replicated).
ROUTERS = ("gate", "router")
# Qwen3.5-MoE's and Qwen3-Next's shared expert (a dense gate/up/down MLP, cut like the experts) and
# its gate (one sigmoid per token, replicated); Nemotron-H's shared experts (up/down, no gate).
SHARED, SHARED_GATE = ("shared_expert", "shared_experts"), "shared_expert_gate"
# Nemotron-H's latent MoE: the experts run in a narrower space, projected in (whole on every rank)
# and out (linear, so the ranks' partial outputs still sum; its bias on rank 0 only).
LATENT_IN, LATENT_OUT = "fc1_latent_proj", "fc2_latent_proj"


def experts_of(block: Any) -> Any | None:
    """The block's experts module when ``block`` is an MoE block (transformers' experts layout:
    3-D ``gate_up_proj`` or ``up_proj`` and ``down_proj`` parameters), else None."""
    experts = getattr(block, "experts", None)
    down = getattr(experts, "down_proj", None)
    return experts if isinstance(down, nn.Parameter) and down.dim() == 3 else None


def extra_parts(block: Any) -> list[str]:
    """What an MoE block holds besides its experts, router, identities and a shared expert (with its
    gate) of up/down (and gate) linears: not sharded."""
    known = ("experts", *ROUTERS, *((*SHARED, SHARED_GATE) if shared_expert(block) is not None else ()))
    return [
        name
        for name, child in block.named_children()
        if name not in known
        and not isinstance(child, nn.Identity)
        and not (name in (LATENT_IN, LATENT_OUT) and isinstance(child, nn.Linear))
    ]


def shared_expert(block: Any) -> Any | None:
    """The block's shared expert when it is a dense MLP of ``up_proj``/``down_proj`` (and
    ``gate_proj``, if any) linears (and its gate, if any, a linear), else None."""
    shared = next((part for name in SHARED if (part := getattr(block, name, None)) is not None), None)
    gate = getattr(block, SHARED_GATE, None)
    names = ("up_proj", "down_proj", *(("gate_proj",) if hasattr(shared, "gate_proj") else ()))
    dense = all(isinstance(getattr(shared, name, None), nn.Linear) for name in names)
    return shared if dense and (gate is None or isinstance(gate, nn.Linear)) else None


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
    if (shared := shared_expert(block)) is not None:
        _shard_dense(shared, rank, ranks)
    latent_out = getattr(block, LATENT_OUT, None)
    if isinstance(latent_out, nn.Linear) and latent_out.bias is not None and rank != 0:
        latent_out.bias.data = torch.zeros_like(latent_out.bias.data)
    block.register_forward_hook(summed_output(all_reduce))


def _shard_dense(mlp: Any, rank: int, ranks: int) -> None:
    """A shared expert's gate/up columns and down rows of this rank (its down bias on rank 0 only),
    unsummed: the block's output is summed once, and ``sigmoid(gate) * sum`` is the sum of the
    ranks' ``sigmoid(gate) * part``."""
    width = int(mlp.down_proj.in_features) // ranks
    first = rank * width
    for name in [name for name in ("gate_proj", "up_proj") if hasattr(mlp, name)]:
        linear = getattr(mlp, name)
        part = nn.Linear(linear.in_features, width, bias=linear.bias is not None)
        part.to(device=linear.weight.device, dtype=linear.weight.dtype)
        part.weight.data = linear.weight.data[first : first + width].clone()
        if part.bias is not None and linear.bias is not None:
            part.bias.data = linear.bias.data[first : first + width].clone()
        setattr(mlp, name, part.requires_grad_(False))
    down = mlp.down_proj
    part = nn.Linear(width, down.out_features, bias=down.bias is not None)
    part.to(device=down.weight.device, dtype=down.weight.dtype)
    part.weight.data = down.weight.data[:, first : first + width].clone()
    if part.bias is not None and down.bias is not None:
        part.bias.data = down.bias.data.clone() if rank == 0 else torch.zeros_like(down.bias.data)
    mlp.down_proj = part.requires_grad_(False)
    if isinstance(getattr(mlp, "intermediate_size", None), int):
        mlp.intermediate_size = width


def _transposed(experts: Any) -> bool:
    return bool(getattr(experts, "is_transposed", False))


def _keep(experts: Any, name: str, dim: int, index: torch.Tensor) -> None:
    """Replaces parameter ``name`` (if the experts have it) by its slices at ``index`` along ``dim``."""
    parameter = getattr(experts, name, None)
    if isinstance(parameter, nn.Parameter):
        kept = parameter.data.index_select(dim, index.to(parameter.device)).contiguous()
        setattr(experts, name, nn.Parameter(kept, requires_grad=False))


def summed_output(all_reduce: AllReduce) -> Callable[[nn.Module, Any, Any], Any]:
    """A forward hook replacing a block's output (the first of a tuple) by its sum over the ranks."""

    def hook(module: nn.Module, args: Any, output: Any) -> Any:
        hidden = (output[0] if isinstance(output, tuple) else output).contiguous()
        all_reduce(hidden)
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

    return hook
