"""Decode attention over the paged KV pool: a Triton kernel and a torch reference.

Design notes: docs/worker.md.
"""

from __future__ import annotations

import importlib.util
import math
import os
from dataclasses import dataclass

import torch

# Tokens per inner-loop tile; a power of two >= 16 (tl.dot's smallest size).
# Registers, not bandwidth, bound it (docs/worker.md).
_TILE_TOKENS = 32
# About two programs per SM on an H100 (132 SMs): below this many
# (sequence, kv head) programs the single pass leaves SMs idle.
_TARGET_PROGRAMS = 256
# The smallest partition worth a separate program (eight tiles).
_MIN_PARTITION_TOKENS = 256
_NUM_WARPS = 4
_NUM_STAGES = 2

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def triton_available() -> bool:
    """Whether triton is installed (it comes with CUDA builds of torch; CPU
    installs may lack it). The kernel also needs CUDA tensors, or triton's
    interpreter for CPU tensors. Importing this module does not import
    triton: a CPU worker never pays for it."""
    return importlib.util.find_spec("triton") is not None


@dataclass(frozen=True)
class DecodePlan:
    """How a call is split: ``partitions == 1`` is the single pass.

    ``partition_tokens`` is the context each split program covers;
    ``tile_tokens`` the tokens per inner-loop step (a power of two >= 16).
    """

    partitions: int
    partition_tokens: int
    tile_tokens: int = _TILE_TOKENS

    @property
    def split(self) -> bool:
        return self.partitions > 1


@dataclass(frozen=True)
class SplitWorkspace:
    """Scratch for a split plan, reusable across calls (and graph replays).

    ``partial_out``: float32 ``[B, H, partitions, head_dim]``;
    ``partial_lse``: float32 ``[B, H, partitions]`` (base-2 log-sum-exp).
    Larger first three dimensions are fine; the kernels never read entries
    that the current call did not write.
    """

    partial_out: torch.Tensor
    partial_lse: torch.Tensor


@dataclass(frozen=True)
class KVScales:
    """An 8-bit cache's scales, ``[num_blocks, block_size, KVH, groups]`` each (a group: the head
    dim's ``head_dim / groups`` consecutive dims; keys have more groups than values), and its
    codes' kind (``int8``, or ``fp8``: float8 e4m3 bits in ``uint8``; worker/attention/kv_quant.py)."""

    keys: torch.Tensor
    values: torch.Tensor
    codes: str

    @property
    def kind(self) -> int:
        """The kernel's ``CODES``: 1 int8, 2 float8 e4m3."""
        return 1 if self.codes == "int8" else 2


def plan_decode(
    batch: int,
    kv_heads: int,
    max_blocks: int,
    block_size: int,
    *,
    split_k: bool | None = None,
    partition_tokens: int | None = None,
    tile_tokens: int = _TILE_TOKENS,
) -> DecodePlan:
    """The plan for these shapes (see docs/worker.md for the rule).

    ``split_k``: None chooses by the rule; False forces the single pass; True
    forces a split (into partitions of ``partition_tokens``, or by the rule's
    sizing without its minimum partition size). Only shapes are read, so the
    same shapes always give the same plan.
    """
    if tile_tokens < 16 or tile_tokens & (tile_tokens - 1):
        raise ValueError(f"tile_tokens must be a power of two >= 16, got {tile_tokens}")
    capacity = max(1, max_blocks * block_size)
    single = DecodePlan(partitions=1, partition_tokens=capacity, tile_tokens=tile_tokens)
    if split_k is False:
        return single
    if partition_tokens is not None:
        if partition_tokens <= 0:
            raise ValueError(f"partition_tokens must be positive, got {partition_tokens}")
        return DecodePlan(math.ceil(capacity / partition_tokens), partition_tokens, tile_tokens)
    programs = max(1, batch * kv_heads)
    if split_k is None and programs >= _TARGET_PROGRAMS:
        return single
    wanted = max(2, math.ceil(_TARGET_PROGRAMS / programs))
    size = math.ceil(math.ceil(capacity / wanted) / tile_tokens) * tile_tokens
    if split_k is None:
        size = max(size, _MIN_PARTITION_TOKENS)
    partitions = math.ceil(capacity / size)
    if split_k is None and partitions < 2:
        return single
    return DecodePlan(partitions=partitions, partition_tokens=size, tile_tokens=tile_tokens)


def interpreting(triton: object) -> bool:
    """Whether Triton runs kernels in its interpreter: ``triton.knobs`` where it exists (3.4+),
    else the ``TRITON_INTERPRET`` variable older releases read."""
    knobs = getattr(triton, "knobs", None)
    runtime = getattr(knobs, "runtime", None)
    if runtime is not None and hasattr(runtime, "interpret"):
        return bool(runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def allocate_split_workspace(query: torch.Tensor, plan: DecodePlan) -> SplitWorkspace:
    """Scratch for ``plan`` with ``query``'s batch, heads and head dim."""
    batch, heads, head_dim = query.shape
    return SplitWorkspace(
        partial_out=torch.empty(
            (batch, heads, plan.partitions, head_dim), dtype=torch.float32, device=query.device
        ),
        partial_lse=torch.empty((batch, heads, plan.partitions), dtype=torch.float32, device=query.device),
    )


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    split_k: bool | None = None,
    plan: DecodePlan | None = None,
    workspace: SplitWorkspace | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    scales: KVScales | None = None,
) -> torch.Tensor:
    """Decode attention of one query token per sequence over the paged pool.

    Shapes: ``query`` ``[B, H, D]``; ``key_cache``/``value_cache``
    ``[num_blocks, block_size, KVH, D]``; ``block_tables`` int32
    ``[B, max_blocks]`` (entries past a row's context are never read);
    ``seq_lens`` int32 ``[B]`` with ``seq_lens[b] <= max_blocks * block_size``
    (not checked: that would read the device). Query head ``h`` reads kv head
    ``h // (H // KVH)``. Returns ``[B, H, D]`` in ``query``'s dtype, written
    into ``out`` when given; rows of length 0 get zeros.

    ``split_k`` / ``plan`` override the shape rule (`plan_decode`);
    ``workspace`` is the split plan's scratch (allocated per call when absent).
    ``window``: only the last ``window`` tokens of a row are read; ``softcap``:
    scores become ``softcap * tanh(score / softcap)``; ``sinks`` (``[H]``, on
    ``query``'s device): a logit per query head added to the softmax's
    denominator only (gpt-oss). ``scales``: the caches hold an 8-bit cache's codes, which the
    kernel widens with these scales. No host synchronisation, so a call can be captured in a CUDA graph. Needs
    CUDA tensors, or CPU tensors in a process that set ``TRITON_INTERPRET=1``
    before importing triton (tests).
    """
    if not triton_available():
        raise RuntimeError("paged_decode_attention needs triton, which is not installed")
    batch, heads, head_dim, kv_heads, block_size = _check_inputs(
        query, key_cache, value_cache, block_tables, seq_lens, out, scales
    )
    import triton

    from worker.attention import triton_decode_kernels as kernels

    interpret = interpreting(triton)
    if query.device.type != "cuda" and not interpret:
        raise ValueError(
            f"query is on {query.device}: the Triton kernel needs CUDA tensors "
            "(or TRITON_INTERPRET=1 for CPU tensors)"
        )
    if out is None:
        out = torch.empty_like(query)
    if batch == 0:
        return out
    if plan is None:
        plan = plan_decode(batch, kv_heads, block_tables.shape[1], block_size, split_k=split_k)
    group = heads // kv_heads
    group_pad = max(16, _next_power_of_two(group))
    head_dim_pad = max(16, _next_power_of_two(head_dim))
    scale_log2 = float(scale) * math.log2(math.e)
    # With a softcap the kernel computes softcap_log2 * tanh(q.k * softcap_scale).
    softcap_scale = float(scale) / softcap if softcap else 0.0
    softcap_log2 = float(softcap) * math.log2(math.e) if softcap else 0.0
    if sinks is not None and (sinks.shape != (heads,) or sinks.device != query.device):
        raise ValueError(f"sinks must be a [{heads}] tensor on {query.device}")
    sinks_arg = sinks.float().contiguous() if sinks is not None else query
    window_arg = int(window) if window else 0
    if plan.split:
        if workspace is None:
            workspace = allocate_split_workspace(query, plan)
        _check_workspace(workspace, batch, heads, head_dim, plan)
        partial_out, partial_lse = workspace.partial_out, workspace.partial_lse
    else:
        # Unused by the single pass; any tensor satisfies the signature.
        partial_out = partial_lse = out

    # Unused by a float cache; any tensor satisfies the signature.
    key_scales, value_scales = (scales.keys, scales.values) if scales is not None else (query, query)
    kernels.decode_partition_kernel[(batch, kv_heads, plan.partitions)](
        query,
        key_cache,
        value_cache,
        key_scales,
        value_scales,
        block_tables,
        seq_lens,
        out,
        partial_out,
        partial_lse,
        sinks_arg,
        scale_log2,
        softcap_scale,
        softcap_log2,
        window_arg,
        plan.partition_tokens,
        query.stride(0),
        query.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        *(key_scales.stride()[:3] if scales is not None else (0, 0, 0)),
        *(value_scales.stride()[:3] if scales is not None else (0, 0, 0)),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        partial_out.stride(0),
        partial_out.stride(1),
        partial_out.stride(2) if plan.split else 0,
        partial_lse.stride(0),
        partial_lse.stride(1),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_SIZE=block_size,
        TILE_TOKENS=plan.tile_tokens,
        SPLIT=plan.split,
        HAS_WINDOW=window_arg > 0,
        HAS_SOFTCAP=softcap_scale > 0,
        HAS_SINKS=sinks is not None,
        IEEE_DOT=query.dtype == torch.float32,
        DOT_IN_FP32=interpret and query.dtype != torch.float32,
        CODES=0 if scales is None else scales.kind,
        KEY_GROUP_DIMS=head_dim if scales is None else head_dim // scales.keys.shape[3],
        VALUE_GROUP_DIMS=head_dim if scales is None else head_dim // scales.values.shape[3],
        num_warps=_NUM_WARPS,
        num_stages=_NUM_STAGES,
    )
    if plan.split:
        kernels.decode_reduce_kernel[(batch, heads)](
            seq_lens,
            partial_out,
            partial_lse,
            out,
            sinks_arg,
            window_arg,
            plan.partition_tokens,
            partial_out.stride(0),
            partial_out.stride(1),
            partial_out.stride(2),
            partial_lse.stride(0),
            partial_lse.stride(1),
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            HAS_WINDOW=window_arg > 0,
            HAS_SINKS=sinks is not None,
            num_warps=_NUM_WARPS,
        )
    return out


def paged_decode_reference(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The same result in plain torch: gather each row's blocks (its last
    ``window`` tokens), then ``softmax(q k^T * scale) v`` in float32, the sink
    logits as an extra column dropped after the softmax. Reads lengths on the
    host (one sync per row): for tests and checks, not for serving."""
    batch, heads, head_dim = query.shape
    _, block_size, kv_heads, _ = key_cache.shape
    group = heads // kv_heads
    out = torch.zeros(batch, heads, head_dim, dtype=torch.float32, device=query.device)
    for row in range(batch):
        length = int(seq_lens[row])
        if length == 0:
            continue
        blocks = block_tables[row, : math.ceil(length / block_size)].long()
        first = max(0, length - window) if window else 0
        keys = key_cache[blocks].reshape(-1, kv_heads, head_dim)[first:length].float()
        values = value_cache[blocks].reshape(-1, kv_heads, head_dim)[first:length].float()
        keys = keys.repeat_interleave(group, dim=1)  # [length, H, D]
        values = values.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,thd->ht", query[row].float(), keys) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        if sinks is not None:
            scores = torch.cat([scores, sinks.float()[:, None]], dim=-1)
        probs = scores.softmax(dim=-1)[:, : keys.shape[0]]
        out[row] = torch.einsum("ht,thd->hd", probs, values)
    return out.to(query.dtype)


def _check_inputs(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor | None,
    scales: KVScales | None = None,
) -> tuple[int, int, int, int, int]:
    """Shape, dtype and layout checks (host metadata only); returns
    ``(B, H, D, KVH, block_size)``."""
    if query.dim() != 3:
        raise ValueError(f"query must be [B, H, D], got shape {tuple(query.shape)}")
    batch, heads, head_dim = query.shape
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(
            "key_cache and value_cache must both be [num_blocks, block_size, KVH, D], got "
            f"{tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
        )
    _, block_size, kv_heads, cache_dim = key_cache.shape
    if cache_dim != head_dim:
        raise ValueError(f"key_cache head dim {cache_dim} differs from query's {head_dim}")
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"query heads ({heads}) must be a multiple of kv heads ({kv_heads})")
    if block_size <= 0 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    if query.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"query dtype {query.dtype} is not float32, float16 or bfloat16")
    _check_cache_dtype(query, key_cache, value_cache, scales)
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2:
        raise ValueError("block_tables must be an int32 [B, max_blocks] tensor")
    if seq_lens.dtype != torch.int32 or seq_lens.shape != (batch,):
        raise ValueError(f"seq_lens must be an int32 [{batch}] tensor")
    if block_tables.shape[0] != batch:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows for a batch of {batch}")
    tensors = {"query": query, "key_cache": key_cache, "value_cache": value_cache}
    if out is not None:
        if out.shape != query.shape or out.dtype != query.dtype:
            raise ValueError("out must have query's shape and dtype")
        tensors["out"] = out
    for name, tensor in tensors.items():
        if tensor.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last (head) dimension")
    if seq_lens.stride(0) != 1 or block_tables.stride(1) != 1:
        raise ValueError("seq_lens and block_tables rows must be contiguous")
    devices = {t.device for t in (*tensors.values(), block_tables, seq_lens)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    return batch, heads, head_dim, kv_heads, block_size


def _check_cache_dtype(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, scales: KVScales | None
) -> None:
    """A float cache in the query's dtype, or an 8-bit cache's codes with scales laid out as its
    blocks' first three dimensions."""
    want = query.dtype if scales is None else (torch.int8 if scales.codes == "int8" else torch.uint8)
    if key_cache.dtype != want or value_cache.dtype != want:
        raise ValueError(
            f"key_cache/value_cache dtype ({key_cache.dtype}/{value_cache.dtype}) must be {want}"
        )
    if scales is not None and not all(
        s.dim() == 4 and s.shape[:3] == key_cache.shape[:3] and key_cache.shape[3] % s.shape[3] == 0
        for s in (scales.keys, scales.values)
    ):
        raise ValueError("the scales must be [num_blocks, block_size, KVH, groups] like the caches")
    if scales is not None and not (scales.keys.stride(-1) == 1 and scales.values.stride(-1) == 1):
        raise ValueError("the scales' groups must be contiguous")


def _check_workspace(
    workspace: SplitWorkspace, batch: int, heads: int, head_dim: int, plan: DecodePlan
) -> None:
    out_shape, lse_shape = workspace.partial_out.shape, workspace.partial_lse.shape
    if (
        workspace.partial_out.dtype != torch.float32
        or workspace.partial_lse.dtype != torch.float32
        or len(out_shape) != 4
        or len(lse_shape) != 3
        or out_shape[0] < batch
        or out_shape[1] < heads
        or out_shape[2] < plan.partitions
        or out_shape[3] != head_dim
        or lse_shape[0] < batch
        or lse_shape[1] < heads
        or lse_shape[2] < plan.partitions
        or workspace.partial_out.stride(-1) != 1
        or workspace.partial_lse.stride(-1) != 1
    ):
        raise ValueError(
            "workspace is too small or not float32: need partial_out "
            f"[>={batch}, >={heads}, >={plan.partitions}, {head_dim}] and partial_lse "
            f"[>={batch}, >={heads}, >={plan.partitions}]"
        )


def _next_power_of_two(value: int) -> int:
    return 1 << max(0, value - 1).bit_length()
