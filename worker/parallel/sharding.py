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
from worker.parallel.experts import expert_width, experts_of, extra_parts, shard_moe, shared_expert
from worker.parallel.hybrid import (
    mixer_linears,
    mixer_of,
    mixer_problems,
    one_part,
    shard_fused_mlp,
    shard_mixer,
    unsharded_piece,
)
from worker.parallel.quantized_shards import WholeRowScale, mxfp4_width, per_token, shard_mxfp4
from worker.parallel.vocabulary import shard_vocabulary
from worker.quant.layers import INT4_GROUP, Fp8Linear, Int4Linear, Int8Linear
from worker.quant.mxfp4 import BLOCK as MXFP4_BLOCK
from worker.quant.mxfp4 import Mxfp4Experts

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj")
MLP_COLUMNS = ("gate_proj", "up_proj")
# A layer's MLP blocks: ``mlp``, or Granite 4's MoE block and shared MLP (fused gate/up) side by side.
MLP_BLOCKS = ("mlp", "block_sparse_moe", "shared_mlp", "feed_forward")
FUSED_MLP = ("input_linear", "output_linear")
LFM2_MLP = ("w1", "w3", "w2")  # LFM2's feed-forward: gate, up, down
ROW_INPUTS = ("down_proj", "output_linear", "w2")  # an MLP's row-parallel projection
AllReduce = Callable[[torch.Tensor], None]
# A pre-quantized checkpoint's layers, cut as they are read (worker/parallel/quantized_shards.py).
CUT_AT_LOAD = (Int4Linear, Int8Linear, Fp8Linear)


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
        self._all_reduce = shard.all_reduce
        # The inputs a pre-quantized part reads: the whole layer's for act-order's spread groups.
        self.rank, self.reads = shard.rank, int(getattr(linear, "inputs", 0))
        if isinstance(linear, CUT_AT_LOAD):  # this rank's columns already
            if shard.rank != 0:
                linear.bias = None
            self.part: nn.Module = linear
            if per_token(linear):
                self.part = WholeRowScale(linear, shard.rank, shard.ranks, shard.all_reduce)
            return
        width = linear.in_features // shard.ranks
        part = nn.Linear(width, linear.out_features, bias=linear.bias is not None and shard.rank == 0)
        part.to(device=linear.weight.device, dtype=linear.weight.dtype)
        part.weight.data = linear.weight.data[:, shard.rank * width : (shard.rank + 1) * width].clone()
        if part.bias is not None and linear.bias is not None:
            part.bias.data = linear.bias.data.clone()
        part.requires_grad_(False)
        self.part = part

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.reads and self.reads != hidden.shape[-1]:  # gathered: the part reads the whole input
            width = hidden.shape[-1]
            whole = hidden.new_zeros(*hidden.shape[:-1], self.reads)
            whole[..., self.rank * width : (self.rank + 1) * width] = hidden
            self._all_reduce(whole)  # exact: each input one rank's value plus zeros
            hidden = whole
        out = self.part(hidden)
        self._all_reduce(out)
        return out


def _rows(linear: nn.Linear, first: int, count: int) -> nn.Linear:
    """A column-parallel slice: output features ``first .. first + count`` of ``linear`` (a
    pre-quantized layer is that slice already)."""
    if isinstance(linear, CUT_AT_LOAD):
        if linear.out_features != count:
            raise ModelLoadError(
                f"a pre-quantized layer of {linear.out_features} outputs, not this rank's {count}"
            )
        return linear
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
    if not isinstance(linear, CUT_AT_LOAD):  # a pre-quantized shard: no whole shape to note (no LoRA)
        note_cut(parent, name, column_cut(linear, first, count))


def _row(parent: nn.Module, name: str, shard: Shard) -> None:
    """Replaces ``parent.name`` by its row-parallel shard, its cut noted for LoRA."""
    linear = getattr(parent, name)
    setattr(parent, name, RowParallel(linear, shard))
    width = linear.in_features // shard.ranks
    if not isinstance(linear, CUT_AT_LOAD):
        note_cut(parent, name, row_cut(linear, shard.rank * width, width, "part"))


def decoder_layers(model: Any) -> list[Any]:
    """The model's decoder layers: the modules with a ``self_attn`` (or a recurrent mixer,
    :func:`worker.parallel.hybrid.mixer_of`) and an ``mlp`` (or Granite 4's ``shared_mlp``), or
    Nemotron-H's one-part blocks (:func:`worker.parallel.hybrid.one_part`)."""
    return [
        m
        for m in model.modules()
        if (
            (hasattr(m, "self_attn") or mixer_of(m) is not None)
            and any(hasattr(m, name) for name in MLP_BLOCKS)
        )
        or one_part(m) is not None
    ]


def attention_of(layer: Any) -> Any | None:
    """The layer's attention (None: a recurrent mixer's or an MLP-only layer)."""
    part = one_part(layer)
    attention = getattr(layer, "self_attn", None) if part is None else part
    return attention if hasattr(attention, "q_proj") else None


def mlp_blocks(layer: Any) -> list[Any]:
    """The layer's MLP blocks (:data:`MLP_BLOCKS` that it has, or a one-part block's MLP or MoE)."""
    part = one_part(layer)
    if part is not None:
        return [part] if hasattr(part, "down_proj") or hasattr(part, "experts") else []
    return [block for name in MLP_BLOCKS if (block := getattr(layer, name, None)) is not None]


def _dense_names(mlp: Any) -> tuple[str, ...]:
    """A dense MLP's projections, the row-parallel one last: gate, up and down (up and down for
    Nemotron-H's; LFM2's w1, w3, w2), or Granite 4's fused input and output."""
    if hasattr(mlp, "input_linear"):
        return FUSED_MLP
    if hasattr(mlp, "w2"):
        return LFM2_MLP
    return (*(MLP_COLUMNS if hasattr(mlp, "gate_proj") else MLP_COLUMNS[1:]), "down_proj")


def _output(attention: Any) -> str:
    """The attention's output projection: ``o_proj``, or ``out_proj`` (LFM2's)."""
    return "out_proj" if hasattr(attention, "out_proj") and not hasattr(attention, "o_proj") else "o_proj"


def _dense_blocks(layer: Any) -> list[Any]:
    """The layer's MLP blocks and its MoE blocks' shared experts."""
    blocks = mlp_blocks(layer)
    return blocks + [shared for block in blocks if (shared := shared_expert(block)) is not None]


def check_shardable(model: Any, ranks: int, quantization: str = "none") -> None:
    """Raises :class:`ModelLoadError` (one line naming what) unless ``model`` splits over ``ranks``:
    a text-only decoder whose every layer has linear q/k/v/o projections and either linear
    gate/up/down projections or an MoE block of experts and a router (a hybrid's layers: a recurrent
    mixer of :mod:`worker.parallel.hybrid` in place of attention), attention heads, the mixers'
    value heads and every MLP's (expert's) width divisible by ``ranks``, KV heads (and the mixers'
    key heads or groups) divisible by it or dividing it; with ``quantization`` int4, no group of the
    row-parallel inputs cut between two ranks."""
    config = model.config
    name = getattr(config, "model_type", type(model).__name__)
    where = f"--tensor-parallel-size {ranks}: {name}"
    if getattr(config, "vision_config", None) is not None:
        raise ModelLoadError(f"{where} is a vision-language model; tensor parallel serves text-only models")
    if (piece := unsharded_piece(model)) is not None:
        raise ModelLoadError(f"{where}: its {piece} are not sharded yet")
    layers = decoder_layers(model)
    if not layers or len(layers) != int(getattr(config, "num_hidden_layers", -1)):
        raise ModelLoadError(f"{where} has layers other than attention and an MLP; not supported yet")
    widths = [
        width for index, layer in enumerate(layers) for width in _checked_widths(layer, index, where, ranks)
    ]
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    problems = [f"{heads} attention heads"] if heads % ranks else []
    if kv_heads % ranks and ranks % kv_heads:
        problems.append(f"{kv_heads} KV heads")
    mixers = [mixer for layer in layers if (mixer := mixer_of(layer)) is not None]
    problems += next((found for mixer in mixers if (found := mixer_problems(mixer, ranks))), [])
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
    mixer, attention = mixer_of(layer), attention_of(layer)
    outputs = [
        (part, name)
        for part, name in ((attention, _output(attention)), (mixer, "out_proj"))
        if part is not None
    ]
    widths = {
        name: int(linear.in_features)
        for name, linear in (
            *((name, getattr(part, name, None)) for part, name in outputs),
            *((name, getattr(block, name, None)) for block in _dense_blocks(layer) for name in ROW_INPUTS),
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


def _checked_widths(layer: Any, index: int, where: str, ranks: int) -> list[int]:
    """The widths layer ``index``'s MLP blocks (or each expert) split; raises
    :class:`ModelLoadError` where a projection is not an ``nn.Linear`` or a pre-quantized layer,
    an MoE block holds more than experts and a router, or a rank's share of MXFP4 experts would
    cut through their blocks."""
    mixer, attention = mixer_of(layer), attention_of(layer)
    parts: list[tuple[Any, tuple[str, ...]]] = []
    if mixer is not None:
        parts.append((mixer, mixer_linears(mixer)))
    if attention is not None or (mixer is None and one_part(layer) is None):  # not an MLP-only block
        attention = attention if attention is not None else layer.self_attn
        parts.append((attention, (*COLUMN_PARALLEL, _output(attention))))
    widths = []
    for block in mlp_blocks(layer):
        experts = experts_of(block)
        if isinstance(mxfp4 := getattr(block, "experts", None), Mxfp4Experts):
            if extra := extra_parts(block):
                raise ModelLoadError(
                    f"{where}: layer {index}'s MoE block has {'/'.join(extra)}; not supported yet"
                )
            width = mxfp4_width(mxfp4)
            if width % ranks == 0 and (width // ranks) % MXFP4_BLOCK:
                raise ModelLoadError(
                    f"{where}: layer {index}'s MXFP4 experts: down_proj's blocks of {MXFP4_BLOCK} inputs "
                    f"would straddle the ranks' cut ({width // ranks} inputs per rank); use fewer ranks"
                )
            widths.append(width)
        elif experts is None:
            parts.append((block, _dense_names(block)))
        elif extra := extra_parts(block):
            raise ModelLoadError(
                f"{where}: layer {index}'s MoE block has {'/'.join(extra)}; not supported yet"
            )
        else:
            widths.append(expert_width(experts))
            if (shared := shared_expert(block)) is not None:
                widths.append(int(shared.down_proj.in_features))
    for part, names in parts:
        if any(not isinstance(getattr(part, n, None), (nn.Linear, *CUT_AT_LOAD)) for n in names):
            kinds = [type(getattr(part, n, None)).__name__ for n in names]
            raise ModelLoadError(
                f"{where}: layer {index} needs nn.Linear or pre-quantized {'/'.join(names)} to shard, "
                f"has {'/'.join(kinds)} (fused projections are not supported yet)"
            )
        if names[-1] in ROW_INPUTS:
            down = getattr(part, names[-1])  # a pre-quantized one is this rank's share already
            widths.append(int(down.in_features) * (ranks if isinstance(down, CUT_AT_LOAD) else 1))
    return widths


def shard_model(model: Any, shard: Shard, quantization: str = "none") -> None:
    """Replaces every decoder layer's float projections by this rank's shards (the model checked by
    :func:`check_shardable` first, for the ``quantization`` the loader gives the shards next), an
    MoE block's experts by their slices (:mod:`worker.parallel.experts`), the embedding and output
    layer by their vocabulary's slices (:mod:`worker.parallel.vocabulary`: every rank gets the
    full logits); norms and routers stay whole."""
    check_shardable(model, shard.ranks, quantization)
    heads = int(model.config.num_attention_heads)
    kv_heads = int(getattr(model.config, "num_key_value_heads", None) or heads)
    for layer in decoder_layers(model):
        if (mixer := mixer_of(layer)) is not None:
            shard_mixer(mixer, shard.rank, shard.ranks, shard.all_reduce)
            mixer.out_proj = RowParallel(mixer.out_proj, shard)
        if (attention := attention_of(layer)) is not None:  # Falcon-H1: both, side by side
            _shard_attention(attention, shard, (heads, kv_heads))
        for mlp in mlp_blocks(layer):
            if isinstance(getattr(mlp, "experts", None), Mxfp4Experts):
                shard_mxfp4(mlp, shard.rank, shard.ranks, shard.all_reduce)
            elif experts_of(mlp) is not None:
                shard_moe(mlp, shard.rank, shard.ranks, shard.all_reduce)
            elif hasattr(mlp, "input_linear"):  # Granite 4's shared MLP: [gate | up] in one linear
                shard_fused_mlp(mlp, shard.rank, shard.ranks)
                mlp.output_linear = RowParallel(mlp.output_linear, shard)
            else:
                *columns, down = _dense_names(mlp)
                row = getattr(mlp, down)  # a pre-quantized one is this rank's share already
                width = row.in_features // (1 if isinstance(row, CUT_AT_LOAD) else shard.ranks)
                for name in columns:
                    _column(mlp, name, shard.rank * width, width)
                _row(mlp, down, shard)
    shard_vocabulary(model, shard.rank, shard.ranks, shard.all_reduce)


def _shard_attention(attention: Any, shard: Shard, counted: tuple[int, int]) -> None:
    """This rank's query heads (and their sinks), and the KV heads they read: a slice of them, or
    the one they share where there are fewer KV heads than ranks (replicated). A query head's rows
    are ``head_dim``, or a query and its output gate (Qwen3.5's, ``2 * head_dim``). ``counted``:
    the config's heads and KV heads, for pre-quantized projections (cut already)."""
    head_dim = int(attention.head_dim)
    if isinstance(attention.q_proj, CUT_AT_LOAD):
        heads, kv_heads = counted
        rows = attention.q_proj.out_features * shard.ranks // heads
    else:
        kv_heads = attention.k_proj.out_features // head_dim
        groups = getattr(attention, "num_key_value_groups", None)
        heads = kv_heads * int(groups) if groups else attention.q_proj.out_features // head_dim
        rows = attention.q_proj.out_features // heads
    local = heads // shard.ranks
    _column(attention, "q_proj", shard.rank * local * rows, local * rows)
    if kv_heads >= shard.ranks:
        local_kv, first_kv = kv_heads // shard.ranks, shard.rank * (kv_heads // shard.ranks)
    else:
        local_kv, first_kv = 1, shard.rank // (shard.ranks // kv_heads)
    _column(attention, "k_proj", first_kv * head_dim, local_kv * head_dim)
    _column(attention, "v_proj", first_kv * head_dim, local_kv * head_dim)
    _row(attention, _output(attention), shard)
    attention.num_key_value_groups = local // local_kv
    sinks = getattr(attention, "sinks", None)
    if isinstance(sinks, nn.Parameter):  # gpt-oss: one per query head
        attention.sinks = nn.Parameter(sinks.data[shard.rank * local : (shard.rank + 1) * local].clone())
