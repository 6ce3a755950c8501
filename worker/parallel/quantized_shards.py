"""A pre-quantized checkpoint's layers cut for a tensor-parallel rank as they are read: the rank's rows
(column-parallel) or input columns (row-parallel) of the codes with their scales and zeros, so its
shard is the whole layer's slice (MXFP4 experts: their packed blocks, once loaded); a cut through
a format's groups is refused naming them. Design notes: docs/worker.md, "Tensor parallelism"."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from worker.parallel.experts import summed_output
from worker.quant.checkpoint_formats import UnsupportedCheckpoint
from worker.quant.fp8_activations import Fp8BlockDynamicLinear, Fp8DynamicLinear, fp8_per_token
from worker.quant.layers import Fp8Linear
from worker.quant.mxfp4 import BLOCK as MXFP4_BLOCK
from worker.quant.mxfp4 import Mxfp4Experts

Tensor = torch.Tensor
# The decoder projections cut by output rows (this rank's heads or MLP width) and by input columns.
ROW_CUT = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
COLUMN_CUT = ("o_proj", "down_proj")


@dataclass(frozen=True)
class Cut:
    """The part of an [out, in] weight a rank keeps: ``rows`` of its outputs, ``columns`` of its inputs."""

    rows: slice
    columns: slice


class QuantizedShards:
    """The :class:`worker.quant.checkpoint_loading.Slicer` of rank ``rank`` of ``ranks`` for a
    model of ``config``: the same cuts :mod:`worker.parallel.sharding` makes of float layers."""

    def __init__(self, rank: int, ranks: int, config: Any):
        self.rank, self.ranks = rank, ranks
        text = getattr(config, "text_config", None) or config
        heads = int(text.num_attention_heads)
        self.kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
        # Heads that do not split: nothing is cut, so the load gets as far as the sharding's own
        # refusal, which names them (worker.parallel.sharding.check_shardable).
        self.uncut = heads % ranks != 0 or (self.kv_heads % ranks != 0 and ranks % self.kv_heads != 0)

    def cut(self, path: str, out_features: int, in_features: int) -> Cut:
        """The rows and columns of layer ``path`` this rank keeps; a quantized layer outside the
        decoder's projections (an output layer, say) is refused: it is not cut."""
        name = path.rpartition(".")[2]
        everything = slice(None)
        if self.uncut:
            return Cut(everything, everything)
        if ".layers." not in path or name not in (*ROW_CUT, *COLUMN_CUT):
            raise UnsupportedCheckpoint(
                f"{path} is quantized; tensor parallelism cuts only the decoder layers' quantized "
                f"projections ({'/'.join((*ROW_CUT, *COLUMN_CUT))})"
            )
        if name in COLUMN_CUT:
            return Cut(everything, self._even(path, in_features, "inputs"))
        if name in ("k_proj", "v_proj") and self.kv_heads < self.ranks:  # replicated KV heads
            head_dim = out_features // self.kv_heads
            first = self.rank // (self.ranks // self.kv_heads) * head_dim
            return Cut(slice(first, first + head_dim), everything)
        return Cut(self._even(path, out_features, "outputs"), everything)

    def _even(self, path: str, size: int, what: str) -> slice:
        if size % self.ranks:
            raise UnsupportedCheckpoint(f"{path}'s {size} {what} do not divide by {self.ranks} ranks")
        width = size // self.ranks
        return slice(self.rank * width, (self.rank + 1) * width)

    def int4(
        self, path: str, q: Tensor, scale: Tensor, zero: Tensor, g_idx: Tensor | None, group: int
    ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """Codes ``q`` [out, in], ``scale`` and ``zero`` [groups, out], act-order's ``g_idx`` [in]
        (each input's group): output rows cut across all three; input columns where the rank's
        columns hold whole groups, whose scales and zeros it then keeps (renumbered). An act-order
        layer whose groups are spread over the inputs (gptqmodel's) keeps its share of the groups
        instead, the other inputs marked -1: its shard reads the whole input (gathered first)."""
        cut = self.cut(path, *q.shape)
        q, scale, zero = q[cut.rows], scale[:, cut.rows], zero[:, cut.rows]
        if cut.columns == slice(None):
            return q, scale, zero, g_idx
        start, stop = cut.columns.start, cut.columns.stop
        plain = torch.arange(q.shape[1], device=q.device) // group
        groups = plain if g_idx is None else g_idx.long()
        mine = groups[start:stop]
        kept, counts = torch.unique(mine, return_counts=True)
        count = int(groups.max()) + 1
        if bool((counts != group).any()) and not torch.equal(groups, plain) and count % self.ranks == 0:
            first = self.rank * (count // self.ranks)
            held = (groups >= first) & (groups < first + count // self.ranks)
            assert g_idx is not None
            local = torch.where(held, groups - first, torch.full_like(groups, -1)).to(g_idx.dtype)
            share = slice(first, first + count // self.ranks)
            return q, scale[share], zero[share], local
        if bool((counts != group).any()):
            kind = "groups" if torch.equal(groups, plain) else "act-order groups"
            raise UnsupportedCheckpoint(
                f"{path}: its int4 {kind} of {group} inputs straddle the {self.ranks} ranks' cut "
                f"({stop - start} inputs per rank); serve it with fewer ranks"
            )
        renumbered = torch.searchsorted(kept, mine)
        local_idx = None if g_idx is None else renumbered.to(g_idx.dtype)
        return q[:, start:stop], scale[kept], zero[kept], local_idx

    def per_row(self, path: str, weight: Tensor, scale: Tensor) -> tuple[Tensor, Tensor]:
        """A weight under one scale per output row: any cut keeps the whole layer's values."""
        cut = self.cut(path, *weight.shape)
        return weight[cut.rows, cut.columns], scale[cut.rows]

    def blocks(
        self, path: str, weight: Tensor, scale: Tensor, block: tuple[int, int], input_group: int
    ) -> tuple[Tensor, Tensor, tuple[int, int]]:
        """A weight under one scale per ``block`` (rows, columns) tile: an output-row cut keeps its
        tiles' scales, on rows of the tiles' common divisor with the cut (repeated, not recomputed);
        an input-column cut must fall between tiles and between the inputs' rounding groups."""
        cut = self.cut(path, *weight.shape)
        rows, columns = block
        if cut.columns != slice(None):
            start, stop = cut.columns.start, cut.columns.stop
            step = math.lcm(columns, input_group or 1)
            if start % step or (stop % step and stop != weight.shape[1]):
                raise UnsupportedCheckpoint(
                    f"{path}: its fp8 tiles of {rows}x{columns} (input groups of {input_group or 'a row'}) "
                    f"straddle the {self.ranks} ranks' cut ({stop - start} inputs per rank); serve it "
                    "with fewer ranks"
                )
            return weight[:, start:stop], scale[:, start // columns : -(-stop // columns)], block
        if cut.rows == slice(None):
            return weight, scale, block
        start, stop = cut.rows.start, cut.rows.stop
        fine = math.gcd(rows, start, stop - start)
        repeated = scale.repeat_interleave(rows // fine, dim=0)
        return weight[start:stop], repeated[start // fine : -(-stop // fine)], (fine, columns)

    def bias(self, path: str, bias: Tensor) -> Tensor:
        """A column-parallel layer's bias cut as its rows; a row-parallel one's whole (the shard
        keeps it on rank 0 alone: :class:`worker.parallel.sharding.RowParallel`)."""
        return bias[self.cut(path, bias.shape[0], 0).rows]


def per_token(layer: torch.nn.Module) -> bool:
    """Whether ``layer`` rounds each input row under the row's own fp8 scale (FP8-dynamic, or
    block FP8 with per-token inputs): a row-parallel shard of it needs the whole row's scale."""
    return isinstance(layer, Fp8DynamicLinear) or (
        isinstance(layer, Fp8BlockDynamicLinear) and not layer.group
    )


class WholeRowScale(torch.nn.Module):
    """A row-parallel shard of a :func:`per_token` layer: its slice of each input row rounded to
    e4m3 under the whole row's scale (the largest magnitude over the ranks: each rank writes its
    rows' into its own column of zeros and one all-reduce sums them, exactly), then the layer's
    product on the upcast weight (CUDA's ``_scaled_mm`` would scale the slice by itself)."""

    def __init__(self, layer: Fp8Linear, rank: int, ranks: int, all_reduce: Callable[[Tensor], None]):
        super().__init__()
        layer.on_cuda_kernel = False
        self.layer, self.rank, self.ranks = layer, rank, ranks
        self._all_reduce = all_reduce
        self.in_features, self.out_features = layer.in_features, layer.out_features

    def forward(self, x: Tensor) -> Tensor:
        mine = x.abs().amax(dim=-1, keepdim=True)
        table = mine.new_zeros(*mine.shape[:-1], self.ranks)
        table[..., self.rank : self.rank + 1] = mine
        self._all_reduce(table)
        rounded = fp8_per_token(x, amax=table.amax(dim=-1, keepdim=True))
        # The product of the class the layer's own rounding is added to (Fp8Linear, Fp8BlockLinear).
        return super(type(self.layer), self.layer).forward(rounded)


def mxfp4_width(experts: Mxfp4Experts) -> int:
    """Each MXFP4 expert's intermediate width (``down_proj``'s inputs)."""
    scales = experts.get_buffer("down_proj_scales")
    return int(scales.shape[2]) * MXFP4_BLOCK


def shard_mxfp4(block: Any, rank: int, ranks: int, all_reduce: Callable[[Tensor], None]) -> None:
    """gpt-oss's MXFP4 experts cut as :func:`worker.parallel.experts.shard_moe` cuts float ones,
    on their packed blocks (no unpacking): every expert's rows of ``gate_up_proj`` for this rank's
    intermediate columns (gate and up interleaved: a pair each), its blocks of ``down_proj``'s
    inputs (refused where the cut is not between blocks of 32), the down bias on rank 0 only, and
    the block's output summed over the ranks."""
    experts = block.experts
    width = mxfp4_width(experts) // ranks
    if width % MXFP4_BLOCK:
        raise UnsupportedCheckpoint(
            f"{type(block).__name__}'s MXFP4 experts: down_proj's blocks of {MXFP4_BLOCK} inputs straddle "
            f"the {ranks} ranks' cut ({width} inputs per rank); serve it with fewer ranks"
        )
    first = rank * width
    pairs = slice(2 * first, 2 * (first + width))
    inputs = slice(first // MXFP4_BLOCK, (first + width) // MXFP4_BLOCK)
    for name, kept in (
        ("gate_up_proj_blocks", (slice(None), pairs)),
        ("gate_up_proj_scales", (slice(None), pairs)),
        ("gate_up_proj_bias", (slice(None), pairs)),
        ("down_proj_blocks", (slice(None), slice(None), inputs)),
        ("down_proj_scales", (slice(None), slice(None), inputs)),
    ):
        setattr(experts, name, getattr(experts, name)[kept].contiguous())
    if rank != 0:
        experts.down_proj_bias = torch.zeros_like(experts.down_proj_bias)  # the ranks' sum adds it once
    block.register_forward_hook(summed_output(all_reduce))
