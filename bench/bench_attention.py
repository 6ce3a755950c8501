"""Decode attention over a paged KV pool: which kernel, at which shapes.

Usage::

    python bench/bench_attention.py                      # CPU: sdpa-gather, flex-eager
    python bench/bench_attention.py --flex-compiled      # CPU: also compiled flex (slow to compile)
    python bench/bench_attention.py --device cuda        # H100: every implementation

Builds one layer's pool, ``[num_blocks, block_size, kv_heads, head_dim]`` for
keys and for values, with each row's blocks scattered over it (the worker's
layout, see ``worker/attention/triton_decode.py``), rows of about the given
context (lengths spread by +-10 %, not multiples of the block size), one
query token per row, and times one call of each implementation, per layer:

- ``sdpa-gather``: gather each row's blocks into a contiguous
  ``[B, KVH, L, D]`` copy, then ``scaled_dot_product_attention`` with a
  length mask (what works anywhere, at the price of copying the context).
- ``flex-eager`` / ``flex-compiled``: ``flex_attention`` reading the pool in
  place through a block mask whose kv indices are the block tables and a
  mask mod that maps a pool position back to the row's position (the idea of
  torch's ``torch.nn.attention.experimental._paged_attention``, on our
  layout). Eager flex computes scores for every pool position (it is the
  reference implementation); compiled flex uses the block mask to skip.
- ``triton`` / ``triton-single``: the worker's kernel with its split rule, and
  forced to a single pass (CUDA only).
- ``...+graph`` (CUDA): sdpa-gather and the Triton kernel captured once as a
  CUDA graph and replayed, as the engine's decode step will be; the eager
  figures include Python and launch costs that a replay does not have.
- ``flashinfer``: ``BatchDecodeWithPagedKVCacheWrapper`` on the same pool
  (``NHD`` layout), when ``flashinfer`` is installed (CUDA only; it
  compiles its kernels on first use).

Each implementation's result is compared with the float32 reference
(``paged_decode_reference``) and the largest difference printed. On CUDA a
call is timed with CUDA events (median of rounds of ``--iters`` calls); on
the CPU with ``perf_counter``. Shapes whose pool would exceed ``--max-kv-mb``
are skipped (the CPU machines here are small and shared).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from worker.attention.triton_decode import (
    paged_decode_attention,
    paged_decode_reference,
    plan_decode,
    triton_available,
)

# name -> (query heads, kv heads, head dim)
MODELS = {"1.7b": (32, 32, 64), "135m": (9, 3, 64)}

Attention = Callable[[], torch.Tensor]


@dataclass
class Pool:
    query: torch.Tensor  # [B, H, D]
    key_cache: torch.Tensor  # [num_blocks, block_size, KVH, D]
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 [B, max_blocks]
    seq_lens: torch.Tensor  # int32 [B]
    scale: float


def build_pool(
    rows: int,
    context: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> Pool:
    generator = torch.Generator().manual_seed(rows * 7919 + context)
    spread = max(1, context // 10)
    lengths = torch.randint(context - spread, context + spread + 1, (rows,), generator=generator)
    blocks_per_row = [math.ceil(int(length) / block_size) for length in lengths]
    max_blocks = max(blocks_per_row)
    num_blocks = sum(blocks_per_row) + 1
    order = torch.randperm(num_blocks, generator=generator)
    tables = torch.zeros(rows, max_blocks, dtype=torch.int32)
    taken = 0
    for row, count in enumerate(blocks_per_row):
        tables[row, :count] = order[taken : taken + count]
        taken += count
    shape = (num_blocks, block_size, kv_heads, head_dim)
    return Pool(
        query=torch.randn(rows, heads, head_dim, generator=generator).to(device, dtype),
        key_cache=torch.randn(shape, generator=generator).to(device, dtype),
        value_cache=torch.randn(shape, generator=generator).to(device, dtype),
        block_tables=tables.to(device),
        seq_lens=lengths.to(torch.int32).to(device),
        scale=head_dim**-0.5,
    )


def sdpa_gather(pool: Pool) -> Attention:
    rows, heads, head_dim = pool.query.shape
    _, block_size, kv_heads, _ = pool.key_cache.shape
    width = pool.block_tables.shape[1] * block_size
    positions = torch.arange(width, device=pool.query.device)
    mask = (positions[None, :] < pool.seq_lens[:, None])[:, None, None, :]
    tables = pool.block_tables.long()
    query = pool.query[:, :, None, :]

    def run() -> torch.Tensor:
        keys = pool.key_cache[tables].reshape(rows, width, kv_heads, head_dim).transpose(1, 2)
        values = pool.value_cache[tables].reshape(rows, width, kv_heads, head_dim).transpose(1, 2)
        out = torch.nn.functional.scaled_dot_product_attention(
            query, keys, values, attn_mask=mask, scale=pool.scale, enable_gqa=heads != kv_heads
        )
        return out[:, :, 0]

    return run


def flex_paged(pool: Pool, compiled: bool) -> Attention:
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    rows, heads, head_dim = pool.query.shape
    num_blocks, block_size, kv_heads, _ = pool.key_cache.shape
    device = pool.query.device
    # The pool seen as one sequence of num_blocks * block_size positions (a view, no copy).
    keys = pool.key_cache.reshape(1, num_blocks * block_size, kv_heads, head_dim).transpose(1, 2)
    values = pool.value_cache.reshape(1, num_blocks * block_size, kv_heads, head_dim)
    values = values.transpose(1, 2)
    used_blocks = (pool.seq_lens + block_size - 1) // block_size
    # Pool block -> its index in the row's table (-1: not the row's).
    logical = torch.full((rows, num_blocks), -1, dtype=torch.int32, device=device)
    columns = torch.arange(pool.block_tables.shape[1], device=device, dtype=torch.int32)
    in_use = columns[None, :] < used_blocks[:, None]
    row_ids = torch.arange(rows, device=device)[:, None].expand_as(pool.block_tables)
    logical[row_ids[in_use], pool.block_tables[in_use].long()] = columns.expand_as(in_use)[in_use]
    seq_lens = pool.seq_lens

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        index = logical[b, kv_idx // block_size]
        return (index >= 0) & (index * block_size + kv_idx % block_size < seq_lens[b])

    # BlockMask sizes its dense form by the kv_indices width, which must
    # exceed the largest block id: one column per pool block, as torch's
    # paged-attention helper does (memory rows x pool blocks).
    kv_indices = torch.zeros(rows, num_blocks, dtype=torch.int32, device=device)
    kv_indices[:, : pool.block_tables.shape[1]] = pool.block_tables
    block_mask = BlockMask.from_kv_blocks(
        used_blocks.to(torch.int32)[:, None, None],
        kv_indices[:, None, None, :],
        BLOCK_SIZE=(128, block_size),
        mask_mod=mask_mod,
        seq_lengths=(1, num_blocks * block_size),
    )
    attend = torch.compile(flex_attention, dynamic=False) if compiled else flex_attention
    query = pool.query[:, :, None, :]

    def run() -> torch.Tensor:
        out = attend(
            query,
            keys,
            values,
            block_mask=block_mask,
            scale=pool.scale,
            enable_gqa=heads != kv_heads,
        )
        return out[:, :, 0]  # type: ignore[index]

    return run


def triton_kernel(pool: Pool, split_k: bool | None) -> Attention:
    out = torch.empty_like(pool.query)

    def run() -> torch.Tensor:
        return paged_decode_attention(
            pool.query,
            pool.key_cache,
            pool.value_cache,
            pool.block_tables,
            pool.seq_lens,
            pool.scale,
            out,
            split_k=split_k,
        )

    return run


def flashinfer_decode(pool: Pool) -> Attention:
    import flashinfer  # type: ignore[import-not-found]

    rows, heads, head_dim = pool.query.shape
    _, block_size, kv_heads, _ = pool.key_cache.shape
    device = pool.query.device
    used_blocks = (pool.seq_lens + block_size - 1) // block_size
    indptr = torch.zeros(rows + 1, dtype=torch.int32, device=device)
    indptr[1:] = torch.cumsum(used_blocks, 0)
    columns = torch.arange(pool.block_tables.shape[1], device=device)
    indices = pool.block_tables[columns[None, :] < used_blocks[:, None]].to(torch.int32)
    last_page_len = (pool.seq_lens - 1) % block_size + 1
    workspace = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device=device)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
    wrapper.plan(
        indptr,
        indices,
        last_page_len,
        heads,
        kv_heads,
        head_dim,
        block_size,
        q_data_type=pool.query.dtype,
        kv_data_type=pool.key_cache.dtype,
        sm_scale=pool.scale,
    )
    cache = (pool.key_cache, pool.value_cache)

    def run() -> torch.Tensor:
        return wrapper.run(pool.query, cache)  # type: ignore[no-any-return]

    return run


def graphed(run: Attention) -> Attention:
    """``run`` captured once as a CUDA graph; the returned function replays it
    (the engine replays its decode step this way, so launch costs vanish)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()

    def replay() -> torch.Tensor:
        graph.replay()
        return out

    return replay


def time_call(run: Attention, device: torch.device, iters: int, rounds: int) -> float:
    """Median milliseconds per call (fewer calls per round for a slow one:
    about half a second per round at most)."""
    began = time.perf_counter()
    run()
    if device.type == "cuda":
        torch.cuda.synchronize()
    first = time.perf_counter() - began
    iters = max(1, min(iters, int(0.5 / max(first, 1e-9))))
    samples = []
    for _ in range(rounds):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                run()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end) / iters)
        else:
            began = time.perf_counter()
            for _ in range(iters):
                run()
            samples.append((time.perf_counter() - began) * 1000 / iters)
    return statistics.median(samples)


def implementations(pool: Pool, args: argparse.Namespace) -> dict[str, Callable[[], Attention]]:
    chosen: dict[str, Callable[[], Attention]] = {
        "sdpa-gather": lambda: sdpa_gather(pool),
        "flex-eager": lambda: flex_paged(pool, compiled=False),
    }
    if args.device == "cuda" or args.flex_compiled:
        chosen["flex-compiled"] = lambda: flex_paged(pool, compiled=True)
    if args.device == "cuda":
        if triton_available():
            chosen["triton"] = lambda: triton_kernel(pool, None)
            chosen["triton-single"] = lambda: triton_kernel(pool, False)
        chosen["flashinfer"] = lambda: flashinfer_decode(pool)
        # What the engine runs: the same calls replayed from a CUDA graph.
        for name in ("sdpa-gather", "triton", "triton-single"):
            if name in chosen:
                chosen[f"{name}+graph"] = lambda make=chosen[name]: graphed(make())
    return chosen


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default=None, help="float32 on cpu, bfloat16 on cuda")
    parser.add_argument("--rows", default=None, help="1,16 on cpu; 1,16,64,256 on cuda")
    parser.add_argument("--contexts", default="200,2000")
    parser.add_argument("--models", default="1.7b,135m", help=",".join(MODELS))
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--iters", type=int, default=None, help="calls per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-kv-mb", type=float, default=None, help="256 on cpu, none on cuda")
    parser.add_argument("--flex-compiled", action="store_true", help="also compiled flex on cpu")
    parser.add_argument("--implementations", default=None, help="comma list to run (default: all that apply)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    on_cuda = device.type == "cuda"
    dtype = getattr(torch, args.dtype or ("bfloat16" if on_cuda else "float32"))
    rows_list = [int(r) for r in (args.rows or ("1,16,64,256" if on_cuda else "1,16")).split(",")]
    iters = args.iters or (50 if on_cuda else 20)
    max_kv_mb = args.max_kv_mb if args.max_kv_mb is not None else (None if on_cuda else 256.0)
    if on_cuda:
        print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, {dtype}")
    else:
        print(f"# cpu, torch {torch.__version__}, {torch.get_num_threads()} threads, {dtype}")
    print("| model | rows | context | plan | implementation | ms per call (one layer) | max diff |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for model in args.models.split(","):
        heads, kv_heads, head_dim = MODELS[model]
        for context in (int(c) for c in args.contexts.split(",")):
            for rows in rows_list:
                kv_mb = 2 * rows * context * kv_heads * head_dim * dtype.itemsize / 2**20
                label = f"| {model} ({heads}/{kv_heads}x{head_dim}) | {rows} | {context} |"
                if max_kv_mb is not None and kv_mb > max_kv_mb:
                    print(f"{label} | (skipped: {kv_mb:.0f} MB of KV > --max-kv-mb) | | |")
                    continue
                pool = build_pool(rows, context, heads, kv_heads, head_dim, args.block_size, dtype, device)
                plan = plan_decode(rows, kv_heads, pool.block_tables.shape[1], args.block_size)
                plan_text = f"{plan.partitions} x {plan.partition_tokens}" if plan.split else "1"
                expected = paged_decode_reference(
                    pool.query,
                    pool.key_cache,
                    pool.value_cache,
                    pool.block_tables,
                    pool.seq_lens,
                    pool.scale,
                ).float()
                for name, make in implementations(pool, args).items():
                    if args.implementations and name not in args.implementations.split(","):
                        continue
                    try:
                        run = make()
                        diff = (run().float() - expected).abs().max().item()
                        ms = time_call(run, device, iters, args.rounds)
                        print(f"{label} {plan_text} | {name} | {ms:.3f} | {diff:.1e} |", flush=True)
                    except Exception as error:  # one failing implementation must not stop the rest
                        reason = f"{type(error).__name__}: {error}".splitlines()[0][:100]
                        print(f"{label} {plan_text} | {name} | failed: {reason} | |", flush=True)
                del pool


if __name__ == "__main__":
    main()
