"""The LoRA kernels (worker/lora/triton_ops.py) against torch's grouped products, in triton's CPU
interpreter (a child process, see tests/triton_interpreter.py): the segmented ones (the start-up
check's step, float32 and float16, segments longer than a row block) and the per-row ones the decode
graphs capture (their start-up check; rows of several slots of ranks up to the slots' rank, base
rows, --max-lora-rank's highest 512), rows of no adapter untouched; here, the fallback to torch's
products where the kernels cannot run, and the kernels compiled for an H100."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from functools import partial

import pytest
import torch

from tests.triton_interpreter import interpreted_results, print_results, ptxas_available
from worker.attention.triton_decode import triton_available
from worker.lora.choice import kernel_problem, lora_ops, lora_row_ops, row_kernel_problem
from worker.lora.ops import Group, grouped_torch, slotted_torch

pytestmark = pytest.mark.slow  # left out of make test-fast

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton is not installed")


def check_startup_step(dtype: torch.dtype) -> None:
    from worker.lora.triton_ops import TritonLora

    assert kernel_problem(TritonLora(), torch.device("cpu"), dtype) is None


def check_long_segments() -> None:
    """Segments of 40 and 3 rows over four slots of rank 8 (two blocks of rows for the first)."""
    from worker.lora.triton_ops import TritonLora

    generator = torch.Generator().manual_seed(1)
    x = torch.randn(50, 33, generator=generator)
    a, b = torch.randn(4, 8, 33, generator=generator), torch.randn(4, 70, 8, generator=generator)
    base = torch.randn(50, 70, generator=generator)
    groups = (Group(3, 8, slice(2, 42)), Group(1, 8, torch.tensor([0, 45, 49])))
    want, got = base.clone(), base.clone()
    grouped_torch(x, a, b, groups, want)
    kernel = TritonLora()
    kernel(x, a, b, groups, got)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert torch.equal(got[[1, 42, 44]], base[[1, 42, 44]])
    again = base.clone()
    kernel(x, a, b, groups, again)  # the same step's next layer: the segments are reused
    assert torch.equal(again, got)


def check_rows_startup_step(dtype: torch.dtype) -> None:
    from worker.lora.triton_ops import TritonRowLora

    assert row_kernel_problem(TritonRowLora(), torch.device("cpu"), dtype) is None


def check_graph_forward_on_the_row_kernels() -> None:
    """The CPU test of the graphs' captured forward (test_lora_graph_inputs.py) with the per-row
    Triton kernels as the graphs' product: equal to the eager steps within 1e-5 of the largest
    logit (their float32 sums run in another order than torch's: 1.9e-5 on logits up to 5)."""
    from tests.unit.worker.test_lora_graph_inputs import check_decode_against_eager
    from worker.lora.triton_ops import TritonRowLora

    check_decode_against_eager(row_ops=TritonRowLora(), scaled=True)


def check_rows(rows: int, ranks: tuple[int, ...], slot_rank: int, features: int, outputs: int) -> None:
    """Rows of every slot (adapters of ``ranks``, zero-padded to the slots' ``slot_rank``) and base
    rows (-1): the per-row kernels add what torch's grouped products add, and leave the base rows
    as they were; torch's per-slot form (the CPU's graph path) agrees too."""
    from worker.lora.triton_ops import TritonRowLora

    generator = torch.Generator().manual_seed(len(ranks) + slot_rank)
    slots = len(ranks)
    x = torch.randn(rows, features, generator=generator)
    a = torch.randn(slots, slot_rank, features, generator=generator)
    b = torch.randn(slots, outputs, slot_rank, generator=generator) / slot_rank**0.5
    for slot, rank in enumerate(ranks):
        a[slot, rank:], b[slot, :, rank:] = 0, 0
    base = torch.randn(rows, outputs, generator=generator)
    row_slots = torch.tensor([(7 * i + 3) % (slots + 1) - 1 for i in range(rows)])
    assert set(row_slots.tolist()) == set(range(-1, slots))
    groups = [Group(s, r, torch.nonzero(row_slots == s)[:, 0]) for s, r in enumerate(ranks)]
    want, got, by_slot = base.clone(), base.clone(), base.clone()
    grouped_torch(x, a, b, groups, want)
    TritonRowLora()(x, a, b, row_slots, got)
    slotted_torch(x, a, b, row_slots, by_slot)
    scale = float(want.abs().max())
    torch.testing.assert_close(got, want, atol=1e-5 * scale, rtol=1e-5)
    torch.testing.assert_close(by_slot, want, atol=1e-5 * scale, rtol=1e-5)
    base_rows = row_slots < 0
    assert torch.equal(got[base_rows], base[base_rows]) and torch.equal(by_slot[base_rows], base[base_rows])
    assert not torch.allclose(got[~base_rows], base[~base_rows])


INTERPRETER_CHECKS: dict[str, Callable[[], None]] = {
    "startup-float32": partial(check_startup_step, torch.float32),
    "startup-float16": partial(check_startup_step, torch.float16),
    "long-segments": check_long_segments,
    "rows-startup-float32": partial(check_rows_startup_step, torch.float32),
    "rows-startup-float16": partial(check_rows_startup_step, torch.float16),
    # --max-lora-rank's default 16: four slots of ranks 16, 8, 3 and 1, features past a block.
    "rows-ranks-up-to-16": partial(check_rows, 37, (16, 8, 3, 1), 16, 300, 150),
    "rows-rank-512": partial(check_rows, 9, (512, 100), 512, 40, 70),  # --max-lora-rank's highest
    "graph-forward-on-row-kernels": check_graph_forward_on_the_row_kernels,
}


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, str | None]:
    return interpreted_results("tests.unit.worker.test_lora_kernels")


@needs_triton
@pytest.mark.parametrize("name", list(INTERPRETER_CHECKS))
def test_interpreted(name: str, interpreter_results: dict[str, str | None]) -> None:
    failure = interpreter_results[name]
    assert failure is None, failure


def test_outside_cuda_torch_products_and_a_failing_kernel_falls_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert lora_ops(torch.device("cpu")) is grouped_torch
    assert lora_row_ops(torch.device("cpu")) is slotted_torch
    with caplog.at_level(logging.ERROR, logger="worker.lora.choice"):
        assert lora_ops(torch.device("cuda", 7)) is grouped_torch  # no such device here: the check fails
        assert lora_row_ops(torch.device("cuda", 7)) is slotted_torch
    assert "the Triton kernels are off" in caplog.text
    assert "the per-row Triton kernels are off" in caplog.text


def test_torch_per_slot_products_pass_the_row_check_and_a_wrong_one_does_not() -> None:
    def noisy(x, a, b, row_slots, out):
        slotted_torch(x, a, b, row_slots, out)
        out[2] += 1.0  # a row of no adapter

    def ignores_slots(x, a, b, row_slots, out):
        slotted_torch(x, a, b, torch.zeros_like(row_slots), out)

    assert row_kernel_problem(slotted_torch, torch.device("cpu")) is None
    assert row_kernel_problem(noisy, torch.device("cpu")) == "it changed rows of no adapter"
    assert row_kernel_problem(ignores_slots, torch.device("cpu")) is not None


def test_a_kernel_that_touches_base_rows_or_differs_is_refused() -> None:
    def noisy(x, a, b, groups, out):
        grouped_torch(x, a, b, groups, out)
        out[19] += 1.0

    def wrong(x, a, b, groups, out):
        grouped_torch(x, a * 2, b, groups, out)

    assert kernel_problem(noisy, torch.device("cpu")) == "it changed rows of no adapter"
    assert "differs from torch's products" in (kernel_problem(wrong, torch.device("cpu")) or "")


@pytest.mark.skipif(not ptxas_available(), reason="triton's CUDA backend (ptxas) is not installed")
def test_the_kernels_compile_for_h100(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compiles (no launch) both kernels for bf16 activations and adapters on an H100."""
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from worker.lora import triton_ops as kernels

    cases = [
        (
            kernels.shrink_kernel,
            {"x_ptr": "*bf16", "a_ptr": "*bf16", "h_ptr": "*fp32"},
            {"BLOCK_M": 16, "BLOCK_R": 16, "BLOCK_K": 32},
        ),
        (
            kernels.expand_kernel,
            {"h_ptr": "*fp32", "b_ptr": "*bf16", "out_ptr": "*bf16"},
            {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_R": 16},
        ),
        (
            kernels.shrink_rows_kernel,
            {"x_ptr": "*bf16", "a_ptr": "*bf16", "h_ptr": "*fp32", "slots_ptr": "*i64"},
            {"BLOCK_R": 16, "BLOCK_K": 128},
        ),
        (
            kernels.expand_rows_kernel,
            {"h_ptr": "*fp32", "b_ptr": "*bf16", "out_ptr": "*bf16", "slots_ptr": "*i64"},
            {"BLOCK_N": 64, "BLOCK_R": 16},
        ),
    ]
    for kernel, pointers, constants in cases:
        names = inspect.signature(kernel.fn).parameters
        signature = {
            name: "constexpr"
            if name in constants
            else pointers.get(name, "*i32" if name.endswith("_ptr") else "i32")
            for name in names
        }
        compiled = triton.compile(
            ASTSource(kernel, signature, constexprs=constants),
            target=GPUTarget("cuda", 90, 32),
            options={"num_warps": 4},
        )
        assert compiled.asm["cubin"], kernel.fn.__name__


if __name__ == "__main__":  # the child process of `interpreter_results`
    print_results(INTERPRETER_CHECKS)
