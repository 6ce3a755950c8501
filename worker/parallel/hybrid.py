"""The recurrent mixers of hybrid models sharded over the tensor-parallel ranks by head: Gated
DeltaNet's key/value heads, Mamba-2's heads and B/C groups (in-projection rows, conv channels,
per-head parameters, a gated norm group spanning ranks summed over them), LFM2's conv channels.

Design notes: docs/worker.md, "Tensor parallelism"."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from worker.model.recurrent import MIXERS

AllReduce = Callable[[torch.Tensor], None]
# A decoder layer's attribute holding its recurrent mixer (Qwen3.5/Qwen3-Next, Granite 4; Nemotron-H's
# one-part blocks hold a mixer, attention, an MLP or an MoE block alike in ``mixer``).
MIXER_ATTRIBUTES = ("linear_attn", "mamba", "mixer", "conv")
DELTANETS = frozenset({"Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet", "Qwen3NextGatedDeltaNet"})
MAMBAS = frozenset({"GraniteMoeHybridMambaLayer", "NemotronHMamba2Mixer", "FalconH1Mixer"})
SHORT_CONVS = frozenset({"Lfm2ShortConv"})  # LFM2: in_proj gives [B | C | x], a conv over B * x
SHARDED = DELTANETS | MAMBAS | SHORT_CONVS


def mixer_of(layer: Any) -> Any | None:
    """The layer's recurrent mixer of a form sharded here (None: an attention layer or another)."""
    for name in MIXER_ATTRIBUTES:
        mixer = getattr(layer, name, None)
        if type(mixer).__name__ in SHARDED:
            return mixer
    return None


def one_part(layer: Any) -> Any | None:
    """The one part of a Nemotron-H block (``mixer``: Mamba-2, attention, an MLP or an MoE block,
    by ``block_type``); None for a layer of another form."""
    return getattr(layer, "mixer", None) if hasattr(layer, "block_type") else None


def unsharded_piece(model: Any) -> str | None:
    """The recurrent mixers of ``model`` (:data:`worker.model.recurrent.MIXERS`) of a form not
    sharded here, by class (None: none)."""
    found = sorted({type(m).__name__ for m in model.modules()} & (MIXERS - SHARDED))
    return f"recurrent mixers ({', '.join(found)})" if found else None


def mixer_linears(mixer: Any) -> tuple[str, ...]:
    """The float ``nn.Linear`` projections ``mixer`` needs to be sharded."""
    if type(mixer).__name__ in MAMBAS | SHORT_CONVS:
        return ("in_proj", "out_proj")
    if hasattr(mixer, "in_proj_qkvz"):  # Qwen3-Next: q/k/v/z and b/a interleaved per key head
        return ("in_proj_qkvz", "in_proj_ba", "out_proj")
    return ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")


def mixer_problems(mixer: Any, ranks: int) -> list[str]:
    """The mixer's head counts that do not split over ``ranks``: value (Mamba) heads must divide by
    it, key heads (B/C groups) divide by it or divide it (then each is replicated on its ranks)."""
    if type(mixer).__name__ in SHORT_CONVS:
        channels = int(mixer.out_proj.in_features)
        return [] if channels % ranks == 0 else [f"{channels} short-convolution channels"]
    if type(mixer).__name__ in MAMBAS:
        heads, shared, names = int(mixer.num_heads), int(mixer.n_groups), ("Mamba heads", "B/C groups")
    else:
        heads, shared = int(mixer.num_v_heads), int(mixer.num_k_heads)
        names = ("linear-attention value heads", "linear-attention key heads")
    found = [f"{heads} {names[0]}"] if heads % ranks else []
    if shared % ranks and ranks % shared:
        found.append(f"{shared} {names[1]}")
    return found


def _heads(heads: int, shared: int, rank: int, ranks: int) -> tuple[list[int], list[int]]:
    """This rank's value heads and the shared (key) heads or groups they read, in order."""
    local = heads // ranks
    mine = list(range(rank * local, (rank + 1) * local))
    per_shared = heads // shared
    return mine, sorted({head // per_shared for head in mine})


def _spans(first: int, width: int, items: Sequence[int]) -> list[int]:
    """The indexes ``first + item * width + [0, width)`` for each item."""
    return [first + item * width + offset for item in items for offset in range(width)]


def shard_mixer(mixer: Any, rank: int, ranks: int, all_reduce: AllReduce) -> None:
    """Keeps this rank's heads of ``mixer`` (every input projection, channel and parameter that
    belongs to them) and sets the attributes its forward reads to the local counts; ``out_proj``
    is left whole for the caller to make row-parallel."""
    if type(mixer).__name__ in MAMBAS:
        _shard_mamba(mixer, rank, ranks, all_reduce)
    elif type(mixer).__name__ in SHORT_CONVS:
        _shard_short_conv(mixer, rank, ranks)
    else:
        _shard_deltanet(mixer, rank, ranks)


def _shard_short_conv(mixer: Any, rank: int, ranks: int) -> None:
    """LFM2's gated short convolution, channel by channel: this rank's channels of B, C and x (each
    the hidden size wide) and of the depthwise conv."""
    channels = int(mixer.out_proj.in_features)
    width = channels // ranks
    mine = list(range(rank * width, (rank + 1) * width))
    mixer.in_proj = _select_rows(mixer.in_proj, [part * channels + c for part in range(3) for c in mine])
    mixer.conv = _select_channels(mixer.conv, mine)


def _shard_deltanet(mixer: Any, rank: int, ranks: int) -> None:
    """Gated DeltaNet: each key head serves ``num_v_heads // num_k_heads`` consecutive value heads;
    the conv runs over ``[q | k | v]`` channels; b, a, A_log, dt_bias are per value head."""
    dk, dv = int(mixer.head_k_dim), int(mixer.head_v_dim)
    key_dim = int(mixer.key_dim)
    values, keys = _heads(int(mixer.num_v_heads), int(mixer.num_k_heads), rank, ranks)
    ratio = int(mixer.num_v_heads) // int(mixer.num_k_heads)
    channels = [*_spans(0, dk, keys), *_spans(key_dim, dk, keys), *_spans(2 * key_dim, dv, values)]
    if hasattr(mixer, "in_proj_qkvz"):  # per key head: [q | k | its v heads | their z]
        block = 2 * dk + 2 * ratio * dv
        rows: list[int] = []
        ba: list[int] = []
        for key in keys:
            own = [value % ratio for value in values if value // ratio == key]
            rows += _spans(key * block, dk, [0, 1])
            rows += _spans(key * block + 2 * dk, dv, own) + _spans(key * block + 2 * dk + ratio * dv, dv, own)
            ba += [key * 2 * ratio + item for item in own] + [key * 2 * ratio + ratio + item for item in own]
        mixer.in_proj_qkvz = _select_rows(mixer.in_proj_qkvz, rows)
        mixer.in_proj_ba = _select_rows(mixer.in_proj_ba, ba)
    else:
        mixer.in_proj_qkv = _select_rows(mixer.in_proj_qkv, channels)
        mixer.in_proj_z = _select_rows(mixer.in_proj_z, _spans(0, dv, values))
        mixer.in_proj_b = _select_rows(mixer.in_proj_b, values)
        mixer.in_proj_a = _select_rows(mixer.in_proj_a, values)
    mixer.conv1d = _select_channels(mixer.conv1d, channels)
    for name in ("A_log", "dt_bias"):
        _keep(mixer, name, values)
    mixer.num_v_heads, mixer.num_k_heads = len(values), len(keys)
    mixer.key_dim, mixer.value_dim = len(keys) * dk, len(values) * dv
    mixer.conv_dim = len(channels)


def _shard_mamba(mixer: Any, rank: int, ranks: int, all_reduce: AllReduce) -> None:
    """Mamba-2: ``in_proj`` gives ``[gate | x | B | C | dt]`` (x and gate by head, B and C by
    group), the conv runs over ``[x | B | C]``; A_log, D, dt_bias are per head."""
    head_dim, state = int(mixer.head_dim), int(mixer.ssm_state_size)
    width, groups = int(mixer.intermediate_size), int(mixer.n_groups)
    heads, kept = _heads(int(mixer.num_heads), groups, rank, ranks)
    x = _spans(0, head_dim, heads)
    b, c = _spans(width, state, kept), _spans(width + groups * state, state, kept)
    conv_dim = int(mixer.conv_dim)
    rows = [*x, *(width + i for i in (*x, *b, *c)), *(width + conv_dim + h for h in heads)]
    mixer.in_proj = _select_rows(mixer.in_proj, rows)
    mup = getattr(mixer, "mup_vector", None)  # Falcon-H1: a multiplier per in_proj output
    if isinstance(mup, torch.Tensor):
        mixer.register_buffer("mup_vector", mup[..., rows].contiguous(), persistent=False)
    mixer.conv1d = _select_channels(mixer.conv1d, [*x, *b, *c])
    for name in ("A_log", "D", "dt_bias"):
        _keep(mixer, name, heads)
    norm = mixer.norm
    if isinstance(getattr(norm, "weight", None), nn.Parameter):  # Falcon-H1's may be an identity
        falcon = hasattr(norm, "norm_before_gate")  # groups by count, gate after the norm if asked
        size = width // int(norm.n_groups) if falcon else int(norm.group_size)
        mixer.norm = GroupedGatedNorm(
            norm.weight.data[x].clone(),
            size,
            float(norm.variance_epsilon),
            first_group=x[0] // size,
            groups=width // size,
            all_reduce=all_reduce,
            falcon=bool(norm.norm_before_gate) if falcon else None,
        )
    mixer.num_heads, mixer.n_groups = len(heads), len(kept)
    mixer.intermediate_size = len(x)
    mixer.conv_dim = len(x) + 2 * len(kept) * state
    if hasattr(mixer, "groups_time_state_size"):
        mixer.groups_time_state_size = len(kept) * state


class GroupedGatedNorm(nn.Module):
    """Mamba-2's gated RMS norm (``x * silu(gate)`` normed per group of ``group_size`` channels) over
    this rank's channels: whole groups where they split by rank; one group spanning several ranks
    has its sum of squares summed over them (each rank's part in its group's column of a
    ``[..., groups]`` all-reduce), so every rank divides by the whole group's variance. ``falcon``
    (Falcon-H1's form: the weight applied in float32; True: the gate after the norm), else None."""

    def __init__(
        self,
        weight: torch.Tensor,
        group_size: int,
        eps: float,
        first_group: int,
        groups: int,
        all_reduce: AllReduce,
        falcon: bool | None = None,
    ):
        super().__init__()
        self.falcon = falcon
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.group_size, self.variance_epsilon = group_size, eps
        self.first_group, self.groups = first_group, groups
        self.spanning = int(weight.shape[0]) < group_size
        self._all_reduce = all_reduce

    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden = hidden_states.to(torch.float32)
        gate_after = bool(self.falcon)
        if gate is not None and not gate_after:
            hidden = hidden * F.silu(gate.to(torch.float32))
        *prefix, last = hidden.shape
        if not self.spanning:
            grouped = hidden.view(*prefix, last // self.group_size, self.group_size)
            grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
            hidden = grouped.view(*prefix, last)
        else:
            squares = hidden.new_zeros(*prefix, self.groups)
            squares[..., self.first_group] = hidden.pow(2).sum(-1)
            self._all_reduce(squares)
            variance = squares[..., self.first_group : self.first_group + 1] / self.group_size
            hidden = hidden * torch.rsqrt(variance + self.variance_epsilon)
        if self.falcon is None:
            return self.weight * hidden.to(input_dtype)
        hidden = self.weight * hidden
        if gate is not None and gate_after:
            hidden = hidden * F.silu(gate.to(torch.float32))
        return hidden.to(input_dtype)


def _select_rows(linear: nn.Linear, rows: Sequence[int]) -> nn.Linear:
    """A column-parallel slice of ``linear``: its output features ``rows``, in that order."""
    index = torch.tensor(list(rows), dtype=torch.long, device=linear.weight.device)
    part = nn.Linear(linear.in_features, len(rows), bias=linear.bias is not None)
    part.to(device=linear.weight.device, dtype=linear.weight.dtype)
    part.weight.data = linear.weight.data.index_select(0, index).contiguous()
    if part.bias is not None and linear.bias is not None:
        part.bias.data = linear.bias.data.index_select(0, index).contiguous()
    part.requires_grad_(False)
    return part


def _select_channels(conv: nn.Conv1d, channels: Sequence[int]) -> nn.Conv1d:
    """A depthwise convolution of ``conv``'s ``channels`` only."""
    index = torch.tensor(list(channels), dtype=torch.long, device=conv.weight.device)
    count = len(channels)
    kernel = int(conv.kernel_size[0])
    part = nn.Conv1d(count, count, kernel, groups=count, padding=kernel - 1, bias=conv.bias is not None)
    part.to(device=conv.weight.device, dtype=conv.weight.dtype)
    part.weight.data = conv.weight.data.index_select(0, index).contiguous()
    if part.bias is not None and conv.bias is not None:
        part.bias.data = conv.bias.data.index_select(0, index).contiguous()
    part.requires_grad_(False)
    return part


def _keep(module: Any, name: str, heads: Sequence[int]) -> None:
    """Replaces the per-head parameter ``name`` by its entries for ``heads``."""
    parameter = getattr(module, name)
    index = torch.tensor(list(heads), dtype=torch.long, device=parameter.device)
    setattr(
        module, name, nn.Parameter(parameter.data.index_select(0, index).contiguous(), requires_grad=False)
    )


def shard_fused_mlp(mlp: Any, rank: int, ranks: int) -> None:
    """Granite 4's shared MLP (``input_linear`` gives ``[gate | up]``, chunked in two): this rank's
    columns of each half; ``output_linear`` is left whole for the caller to make row-parallel."""
    whole = int(mlp.output_linear.in_features)
    width = whole // ranks
    first = rank * width
    mlp.input_linear = _select_rows(
        mlp.input_linear, [*range(first, first + width), *range(whole + first, whole + first + width)]
    )
    if isinstance(getattr(mlp, "hidden_size", None), int):
        mlp.hidden_size = width
