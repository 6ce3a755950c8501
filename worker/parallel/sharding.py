"""A decoder sharded Megatron-style over the tensor-parallel ranks: attention heads (and their sinks)
and MLP or experts' columns split by rank, one all-reduce after attention and one after the MLP.

Design notes: docs/worker.md, "Tensor parallelism".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from worker.model.loader import ModelLoadError
from worker.parallel.adapters import column_cut, note_cut, row_cut
from worker.parallel.experts import expert_width, experts_of, extra_parts, shard_moe
from worker.parallel.vocabulary import shard_vocabulary
from worker.quant.layers import INT4_GROUP

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj")
MLP_COLUMNS = ("gate_proj", "up_proj")
AllReduce = Callable[[torch.Tensor], None]


@dataclass(frozen=True)
class Shard:
    """This rank's place: ``rank`` of ``ranks``, and the sum over the ranks (in place)."""

    rank: int
    ranks: int
    all_reduce: AllReduce


class RowParallel(nn.Module):
    """A row-parallel linear: this rank's slice of the input features times its columns of the
    weight (the bias on rank 0 only), then the ranks' partial outputs summed."""

    def __init__(self, linear: nn.Linear, shard: Shard):
        super().__init__()
        width = linear.in_features // shard.ranks
        part = nn.Linear(width, linear.out_features, bias=linear.bias is not None and shard.rank == 0)
        part.to(device=linear.weight.device, dtype=linear.weight.dtype)
        part.weight.data = linear.weight.data[:, shard.rank * width : (shard.rank + 1) * width].clone()
        if part.bias is not None and linear.bias is not None:
            part.bias.data = linear.bias.data.clone()
        part.requires_grad_(False)
        self.part = part
        self._all_reduce = shard.all_reduce

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.part(hidden)
        self._all_reduce(out)
        return out


def _rows(linear: nn.Linear, first: int, count: int) -> nn.Linear:
    """A column-parallel slice: output features ``first .. first + count`` of ``linear``."""
    part = nn.Linear(linear.in_features, count, bias=linear.bias is not None)
    part.to(device=linear.weight.device, dtype=linear.weight.dtype)
    part.weight.data = linear.weight.data[first : first + count].clone()
    if part.bias is not None and linear.bias is not None:
        part.bias.data = linear.bias.data[first : first + count].clone()
    part.requires_grad_(False)
    return part


def _column(parent: nn.Module, name: str, first: int, count: int) -> None:
    """Replaces ``parent.name`` by its column-parallel slice (:func:`_rows`), its cut noted for LoRA."""
    linear = getattr(parent, name)
    setattr(parent, name, _rows(linear, first, count))
    note_cut(parent, name, column_cut(linear, first, count))


def _row(parent: nn.Module, name: str, shard: Shard) -> None:
    """Replaces ``parent.name`` by its row-parallel shard, its cut noted for LoRA."""
    linear = getattr(parent, name)
    setattr(parent, name, RowParallel(linear, shard))
    width = linear.in_features // shard.ranks
    note_cut(parent, name, row_cut(linear, shard.rank * width, width, "part"))


def decoder_layers(model: Any) -> list[Any]:
    """The model's decoder layers: the modules with a ``self_attn`` and an ``mlp``."""
    return [m for m in model.modules() if hasattr(m, "self_attn") and hasattr(m, "mlp")]


def check_shardable(model: Any, ranks: int, quantization: str = "none") -> None:
    """Raises :class:`ModelLoadError` (one line naming what) unless ``model`` splits over ``ranks``:
    a text-only decoder whose every layer has linear q/k/v/o projections and either linear
    gate/up/down projections or an MoE block of experts and a router, attention heads and every
    MLP's (expert's) width divisible by ``ranks``, KV heads divisible by it or dividing it; with
    ``quantization`` int4, no group of the row-parallel inputs cut between two ranks."""
    config = model.config
    name = getattr(config, "model_type", type(model).__name__)
    where = f"--tensor-parallel-size {ranks}: {name}"
    if getattr(config, "vision_config", None) is not None:
        raise ModelLoadError(f"{where} is a vision-language model; tensor parallel serves text-only models")
    layers = decoder_layers(model)
    if not layers or len(layers) != int(getattr(config, "num_hidden_layers", -1)):
        raise ModelLoadError(f"{where} has layers other than attention and an MLP; not supported yet")
    widths = [_checked_width(layer, index, where) for index, layer in enumerate(layers)]
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    problems = [f"{heads} attention heads"] if heads % ranks else []
    if kv_heads % ranks and ranks % kv_heads:
        problems.append(f"{kv_heads} KV heads")
    width = next((width for width in widths if width % ranks), None)
    if width is not None:
        problems.append(f"an MLP width of {width}")
    if problems:
        raise ModelLoadError(f"{where} has {' and '.join(problems)}, which do not divide by {ranks}")
    if quantization == "int4":
        for layer in layers:
            _check_groups(layer, ranks, where)


def _check_groups(layer: Any, ranks: int, where: str) -> None:
    """Raises :class:`ModelLoadError` where a row-parallel projection's int4 groups (along its input)
    would straddle the ranks' cut: a rank's codes would then differ from the whole layer's."""
    widths = {
        name: int(linear.in_features)
        for name, linear in (
            ("o_proj", layer.self_attn.o_proj),
            ("down_proj", getattr(layer.mlp, "down_proj", None)),
        )
        if isinstance(linear, nn.Linear)
    }
    cut = [
        f"{name} ({width // ranks} inputs per rank)"
        for name, width in widths.items()
        if width % INT4_GROUP == 0 and (width // ranks) % INT4_GROUP
    ]
    if cut:
        raise ModelLoadError(
            f"{where}: --quantization int4's groups of {INT4_GROUP} would straddle the ranks' cut of "
            f"{' and '.join(cut)}; use int8 or fewer ranks"
        )


def _checked_width(layer: Any, index: int, where: str) -> int:
    """The width layer ``index``'s MLP (or each expert) splits; raises :class:`ModelLoadError` where
    a projection is not a float ``nn.Linear`` or an MoE block holds more than experts and a router."""
    parts: list[tuple[Any, tuple[str, ...]]] = [(layer.self_attn, (*COLUMN_PARALLEL, "o_proj"))]
    experts = experts_of(layer.mlp)
    if experts is None:
        parts.append((layer.mlp, (*MLP_COLUMNS, "down_proj")))
    elif extra := extra_parts(layer.mlp):
        raise ModelLoadError(f"{where}: layer {index}'s MoE block has {'/'.join(extra)}; not supported yet")
    for part, names in parts:
        if any(not isinstance(getattr(part, n, None), nn.Linear) for n in names):
            kinds = [type(getattr(part, n, None)).__name__ for n in names]
            raise ModelLoadError(
                f"{where}: layer {index} needs float nn.Linear {'/'.join(names)} to shard, has "
                f"{'/'.join(kinds)} (hybrid layers and pre-quantized checkpoints are not supported yet)"
            )
    return expert_width(experts) if experts is not None else int(layer.mlp.gate_proj.out_features)


def shard_model(model: Any, shard: Shard, quantization: str = "none") -> None:
    """Replaces every decoder layer's float projections by this rank's shards (the model checked by
    :func:`check_shardable` first, for the ``quantization`` the loader gives the shards next), an
    MoE block's experts by their slices (:mod:`worker.parallel.experts`), the embedding and output
    layer by their vocabulary's slices (:mod:`worker.parallel.vocabulary`: every rank gets the
    full logits); norms and routers stay whole."""
    check_shardable(model, shard.ranks, quantization)
    for layer in decoder_layers(model):
        _shard_attention(layer.self_attn, shard)
        mlp = layer.mlp
        if experts_of(mlp) is not None:
            shard_moe(mlp, shard.rank, shard.ranks, shard.all_reduce)
            continue
        width = mlp.gate_proj.out_features // shard.ranks
        for name in MLP_COLUMNS:
            _column(mlp, name, shard.rank * width, width)
        _row(mlp, "down_proj", shard)
    shard_vocabulary(model, shard.rank, shard.ranks, shard.all_reduce)


def _shard_attention(attention: Any, shard: Shard) -> None:
    """This rank's query heads (and their sinks), and the KV heads they read: a slice of them, or
    the one they share where there are fewer KV heads than ranks (replicated)."""
    head_dim = int(attention.head_dim)
    heads = attention.q_proj.out_features // head_dim
    kv_heads = attention.k_proj.out_features // head_dim
    local = heads // shard.ranks
    _column(attention, "q_proj", shard.rank * local * head_dim, local * head_dim)
    if kv_heads >= shard.ranks:
        local_kv, first_kv = kv_heads // shard.ranks, shard.rank * (kv_heads // shard.ranks)
    else:
        local_kv, first_kv = 1, shard.rank // (shard.ranks // kv_heads)
    _column(attention, "k_proj", first_kv * head_dim, local_kv * head_dim)
    _column(attention, "v_proj", first_kv * head_dim, local_kv * head_dim)
    _row(attention, "o_proj", shard)
    attention.num_key_value_groups = local // local_kv
    sinks = getattr(attention, "sinks", None)
    if isinstance(sinks, nn.Parameter):  # gpt-oss: one per query head
        attention.sinks = nn.Parameter(sinks.data[shard.rank * local : (shard.rank + 1) * local].clone())
