"""The Triton paged decode attention kernel against its torch reference.

There is no GPU in CI, so the kernels run under triton's CPU interpreter.
triton must see ``TRITON_INTERPRET=1`` before it is imported (its own library
functions are decorated at import), so the interpreter checks run in one
child process (this file run as a module, with the variable set:
tests/triton_interpreter.py) and each
parametrized test reports its own check; nothing else in the test process
sees the interpreter. One more test compiles the kernels for an H100 (sm_90)
with the ptxas that ships with triton, which catches what only the GPU
compiler rejects. Shapes stay small: the interpreter runs every program in
Python.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from functools import partial

import pytest
import torch

from tests.triton_interpreter import interpreted_results, print_results, ptxas_available
from worker.attention.triton_decode import (
    DecodePlan,
    SplitWorkspace,
    allocate_split_workspace,
    paged_decode_attention,
    paged_decode_reference,
    plan_decode,
    triton_available,
)

pytestmark = pytest.mark.slow  # left out of make test-fast

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton is not installed")

# Zero (padding), one, a block's worth, and lengths that end inside a block.
SEQ_LENS = [37, 0, 1, 16, 70]
NUM_BLOCKS = 40


def random_pool(
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    block_size: int = 16,
    seq_lens: list[int] = SEQ_LENS,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """query, key_cache, value_cache, block_tables (scattered, rows may share
    blocks, unused entries point anywhere), seq_lens."""
    generator = torch.Generator().manual_seed(seed)
    num_blocks = max(NUM_BLOCKS, math.ceil(max(seq_lens) / block_size) + 2)
    pool_shape = (num_blocks, block_size, kv_heads, head_dim)
    key_cache = torch.randn(pool_shape, generator=generator).to(dtype)
    value_cache = torch.randn(pool_shape, generator=generator).to(dtype)
    max_blocks = math.ceil(max(seq_lens) / block_size) + 1
    block_tables = torch.stack(
        [torch.randperm(num_blocks, generator=generator)[:max_blocks] for _ in seq_lens]
    ).to(torch.int32)
    query = torch.randn((len(seq_lens), heads, head_dim), generator=generator).to(dtype)
    return query, key_cache, value_cache, block_tables, torch.tensor(seq_lens, dtype=torch.int32)


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}


def check_against_reference(
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    split_k: bool,
    block_size: int,
) -> None:
    query, key_cache, value_cache, block_tables, seq_lens = random_pool(
        heads, kv_heads, head_dim, dtype, block_size
    )
    scale = head_dim**-0.5
    result = paged_decode_attention(
        query, key_cache, value_cache, block_tables, seq_lens, scale, split_k=split_k
    )
    expected = paged_decode_reference(query, key_cache, value_cache, block_tables, seq_lens, scale)
    assert result.dtype == dtype
    assert result.shape == query.shape
    torch.testing.assert_close(result.float(), expected.float(), **tolerance(dtype))
    assert torch.all(result[1] == 0)  # the padding row


def check_out_and_stale_workspace(split_k: bool) -> None:
    """Writes into ``out`` (the padding row included) and never reads scratch
    it did not write in this call: a NaN-filled workspace changes nothing."""
    query, key_cache, value_cache, block_tables, seq_lens = random_pool(9, 3, 64, torch.float32)
    plan = plan_decode(len(SEQ_LENS), 3, block_tables.shape[1], 16, split_k=split_k)
    assert plan.split == split_k
    out = torch.full_like(query, float("nan"))
    workspace = allocate_split_workspace(query, plan)
    workspace.partial_out.fill_(float("nan"))
    workspace.partial_lse.fill_(float("nan"))
    result = paged_decode_attention(
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        0.125,
        out,
        plan=plan,
        workspace=workspace,
    )
    assert result is out
    expected = paged_decode_reference(query, key_cache, value_cache, block_tables, seq_lens, 0.125)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def check_uneven_partitions_and_tiles() -> None:
    """Partitions that are not a multiple of the tile, a small tile, and a
    workspace larger than the plan needs (a bigger bucket's, reused)."""
    query, key_cache, value_cache, block_tables, seq_lens = random_pool(9, 3, 64, torch.bfloat16)
    plan = DecodePlan(partitions=4, partition_tokens=20, tile_tokens=16)
    big = allocate_split_workspace(torch.empty(8, 12, 64), DecodePlan(6, 20))
    workspace = SplitWorkspace(big.partial_out, big.partial_lse)
    result = paged_decode_attention(
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        0.125,
        plan=plan,
        workspace=workspace,
    )
    expected = paged_decode_reference(query, key_cache, value_cache, block_tables, seq_lens, 0.125)
    torch.testing.assert_close(result.float(), expected.float(), atol=2e-2, rtol=2e-2)


def check_variant(split_k: bool, window: int | None, softcap: float | None, sinks: bool) -> None:
    """A sliding window (rows shorter and longer than it; with a split, whole partitions before
    it), a logit softcap and sink logits, against the reference."""
    query, key_cache, value_cache, block_tables, seq_lens = random_pool(9, 3, 64, torch.float32)
    plan = plan_decode(len(SEQ_LENS), 3, block_tables.shape[1], 16, split_k=split_k, partition_tokens=16)
    head_sinks = torch.randn(9, generator=torch.Generator().manual_seed(1)) if sinks else None
    variant = {"window": window, "softcap": softcap, "sinks": head_sinks}
    result = paged_decode_attention(
        query, key_cache, value_cache, block_tables, seq_lens, 0.3, plan=plan, **variant
    )
    expected = paged_decode_reference(query, key_cache, value_cache, block_tables, seq_lens, 0.3, **variant)
    torch.testing.assert_close(result, expected, atol=1e-5, rtol=1e-5)
    assert torch.all(result[1] == 0)  # the padding row


def check_without_knobs() -> None:
    """A Triton without ``triton.knobs`` (before 3.4): the interpreter is read from the environment."""
    import triton

    knobs = triton.__dict__.pop("knobs", None)
    try:
        check_against_reference(4, 4, 64, torch.float32, False, 16)
    finally:
        if knobs is not None:
            triton.knobs = knobs


# name -> a check that raises when the kernel (interpreted) is wrong.
INTERPRETER_CHECKS: dict[str, Callable[[], None]] = {
    # SmolLM2-135M's group of 3
    "gqa3-d64-fp32-single": partial(check_against_reference, 9, 3, 64, torch.float32, False, 16),
    "gqa3-d64-bf16-split": partial(check_against_reference, 9, 3, 64, torch.bfloat16, True, 16),
    # Llama-3-8B's group of 4
    "gqa4-d128-fp32-split": partial(check_against_reference, 8, 2, 128, torch.float32, True, 16),
    "gqa4-d128-bf16-single": partial(check_against_reference, 8, 2, 128, torch.bfloat16, False, 16),
    # No grouping (SmolLM2-1.7B), 8-token blocks
    "mha-d64-bf16-split-block8": partial(check_against_reference, 4, 4, 64, torch.bfloat16, True, 8),
    # A block larger than a tile
    "mha-d128-fp32-single-block64": partial(check_against_reference, 4, 4, 128, torch.float32, False, 64),
    # A head dim padded to the next power of two
    "gqa3-d80-fp16-split": partial(check_against_reference, 6, 2, 80, torch.float16, True, 16),
    "out-stale-workspace-single": partial(check_out_and_stale_workspace, False),
    "out-stale-workspace-split": partial(check_out_and_stale_workspace, True),
    "uneven-partitions": check_uneven_partitions_and_tiles,
    "window-single": partial(check_variant, False, 20, None, False),
    "window-split": partial(check_variant, True, 20, None, False),
    "softcap-single": partial(check_variant, False, None, 2.0, False),
    "sinks-single": partial(check_variant, False, None, None, True),
    "sinks-split": partial(check_variant, True, None, None, True),
    "window-softcap-sinks-split": partial(check_variant, True, 5, 2.0, True),
    "no-triton-knobs": check_without_knobs,
}


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, str | None]:
    return interpreted_results("tests.unit.worker.test_triton_decode")


@needs_triton
@pytest.mark.parametrize("name", list(INTERPRETER_CHECKS))
def test_interpreted_kernel(name: str, interpreter_results: dict[str, str | None]) -> None:
    failure = interpreter_results[name]
    assert failure is None, failure


def test_reference_matches_dense_attention() -> None:
    """The reference itself, on a pool whose blocks are in order, against
    torch's dense scaled-dot-product attention."""
    length, block_size = 37, 16
    query, key_cache, value_cache, _, _ = random_pool(9, 3, 64, torch.float32, seq_lens=[length])
    blocks = math.ceil(length / block_size)
    block_tables = torch.arange(blocks, dtype=torch.int32)[None]
    keys = key_cache[:blocks].reshape(-1, 3, 64)[:length].transpose(0, 1)[None]
    values = value_cache[:blocks].reshape(-1, 3, 64)[:length].transpose(0, 1)[None]
    dense = torch.nn.functional.scaled_dot_product_attention(
        query[:, :, None], keys, values, scale=0.125, enable_gqa=True
    )[:, :, 0]
    seq_lens = torch.tensor([length], dtype=torch.int32)
    reference = paged_decode_reference(query, key_cache, value_cache, block_tables, seq_lens, 0.125)
    torch.testing.assert_close(reference, dense, atol=1e-5, rtol=1e-5)


def test_plan_rule() -> None:
    # Few programs, long tables: split into partitions of at least 256 tokens.
    one_row = plan_decode(1, 32, 512, 16)
    assert one_row.split
    assert one_row.partition_tokens >= 256
    assert one_row.partitions * one_row.partition_tokens >= 512 * 16
    # Fewer kv heads, more partitions (down to the smallest partition).
    fewer_heads = plan_decode(1, 3, 512, 16)
    assert fewer_heads.partitions > one_row.partitions
    assert fewer_heads.partition_tokens == 256
    # Enough programs already, or too short a table to cut: one pass.
    assert not plan_decode(16, 32, 128, 16).split
    assert not plan_decode(1, 3, 16, 16).split
    # Overrides, and the same shapes always give the same plan (graph capture).
    assert not plan_decode(1, 3, 128, 16, split_k=False).split
    assert plan_decode(64, 32, 4, 16, split_k=True).split
    assert plan_decode(1, 3, 128, 16) == plan_decode(1, 3, 128, 16)


@needs_triton
@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"block_tables": torch.zeros(5, 6, dtype=torch.int64)}, "block_tables"),
        ({"seq_lens": torch.zeros(4, dtype=torch.int32)}, "seq_lens"),
        ({"query": torch.zeros(5, 8, 64)}, "kv heads"),
        ({"key_cache": torch.zeros(40, 16, 3, 64, dtype=torch.float16)}, "key_cache"),
        ({"out": torch.zeros(5, 9, 32)}, "out"),
    ],
)
def test_bad_input_names_the_argument(change: dict[str, torch.Tensor], field: str) -> None:
    query, key_cache, value_cache, block_tables, seq_lens = random_pool(9, 3, 64, torch.float32)
    arguments = {
        "query": query,
        "key_cache": key_cache,
        "value_cache": value_cache,
        "block_tables": block_tables,
        "seq_lens": seq_lens,
        "scale": 0.125,
        "out": None,
    }
    arguments.update(change)
    with pytest.raises(ValueError, match=field):
        paged_decode_attention(**arguments)  # type: ignore[arg-type]


needs_cuda = pytest.mark.skipif(
    not (triton_available() and torch.cuda.is_available()), reason="needs CUDA and triton"
)


@needs_cuda
@pytest.mark.parametrize("split_k", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_graph_replays_with_new_lengths(split_k: bool, dtype: torch.dtype) -> None:
    """On a GPU (skipped in CI): an eager call with ``out`` and a workspace
    allocates nothing, and a captured call replays correctly after the
    lengths change in place (rows growing, shrinking, becoming padding)."""
    query, key_cache, value_cache, block_tables, seq_lens = (
        tensor.cuda() for tensor in random_pool(9, 3, 64, dtype)
    )
    plan = plan_decode(len(SEQ_LENS), 3, block_tables.shape[1], 16, split_k=split_k)
    out = torch.empty_like(query)
    workspace = allocate_split_workspace(query, plan)

    def call() -> None:
        paged_decode_attention(
            query,
            key_cache,
            value_cache,
            block_tables,
            seq_lens,
            0.125,
            out,
            plan=plan,
            workspace=workspace,
        )

    call()  # compiles the kernels
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    call()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == allocated
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for lengths in (SEQ_LENS, [5, 70, 0, 33, 2]):
        seq_lens.copy_(torch.tensor(lengths, dtype=torch.int32))
        graph.replay()
        expected = paged_decode_reference(query, key_cache, value_cache, block_tables, seq_lens, 0.125)
        torch.testing.assert_close(out.float(), expected.float(), **tolerance(dtype))


@pytest.mark.skipif(not ptxas_available(), reason="triton's CUDA backend (ptxas) is not installed")
@pytest.mark.parametrize(
    ("split", "variants", "codes"),
    [
        (False, False, 0),
        (True, False, 0),
        (False, True, 0),
        (True, True, 0),
        (False, False, 1),  # an int8 cache
        (True, True, 2),  # an fp8 cache (float8 e4m3 bits)
    ],
    ids=["plain", "plain-split", "variants", "variants-split", "int8", "fp8-variants-split"],
)
def test_kernels_compile_for_h100(
    split: bool, variants: bool, codes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Compiles (no launch) the kernels as a bf16 call of the 135M shape
    would on an H100 (plain, or with a window, a softcap and sinks; on a float,
    int8 or fp8 cache): catches what the interpreter accepts but the GPU
    compiler rejects."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from worker.attention import triton_decode_kernels as kernels

    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9 warns when unset
    cache = ["*bf16", "*i8", "*u8"][codes]
    pointers = {
        "query_ptr": "*bf16",
        "key_cache_ptr": cache,
        "value_cache_ptr": cache,
        "key_scales_ptr": "*bf16",
        "value_scales_ptr": "*bf16",
        "block_tables_ptr": "*i32",
        "seq_lens_ptr": "*i32",
        "out_ptr": "*bf16",
        "partial_out_ptr": "*fp32",
        "partial_lse_ptr": "*fp32",
        "sinks_ptr": "*fp32",
        "scale_log2": "fp32",
        "softcap_scale": "fp32",
        "softcap_log2": "fp32",
    }
    partition_constants = {
        "HEAD_DIM": 64,
        "HEAD_DIM_PAD": 64,
        "GROUP": 3,
        "GROUP_PAD": 16,
        "BLOCK_SIZE": 16,
        "TILE_TOKENS": 32,
        "SPLIT": split,
        "HAS_WINDOW": variants,
        "HAS_SOFTCAP": variants,
        "HAS_SINKS": variants,
        "IEEE_DOT": False,
        "DOT_IN_FP32": False,
        "CODES": codes,
        "KEY_GROUP_DIMS": 4 if codes else 64,
        "VALUE_GROUP_DIMS": 32 if codes else 64,
    }
    reduce_constants = {"HEAD_DIM": 64, "HEAD_DIM_PAD": 64, "HAS_WINDOW": variants, "HAS_SINKS": variants}

    def signature(kernel: object, constants: dict[str, object]) -> dict[str, str]:
        names = inspect.signature(kernel.fn).parameters  # type: ignore[attr-defined]
        return {name: "constexpr" if name in constants else pointers.get(name, "i32") for name in names}

    target = GPUTarget("cuda", 90, 32)
    compiled = triton.compile(
        ASTSource(
            kernels.decode_partition_kernel,
            signature(kernels.decode_partition_kernel, partition_constants),
            constexprs=partition_constants,
        ),
        target=target,
        options={"num_warps": 4, "num_stages": 2},
    )
    assert compiled.asm["cubin"]
    if split:
        reduced = triton.compile(
            ASTSource(
                kernels.decode_reduce_kernel,
                signature(kernels.decode_reduce_kernel, reduce_constants),
                constexprs=reduce_constants,
            ),
            target=target,
            options={"num_warps": 4},
        )
        assert reduced.asm["cubin"]


if __name__ == "__main__":  # the child process of `interpreter_results`
    print_results(INTERPRETER_CHECKS)
