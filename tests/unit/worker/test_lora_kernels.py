"""The segmented LoRA kernels (worker/lora/triton_ops.py) against torch's grouped products, in
triton's CPU interpreter (a child process, see tests/triton_interpreter.py): the start-up check's
step, float32 and float16, segments longer than a row block, rows of no adapter untouched; here,
the fallback to torch's products where the kernels cannot run, and the kernels compiled for an H100."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from functools import partial

import pytest
import torch

from tests.triton_interpreter import interpreted_results, print_results, ptxas_available
from worker.attention.triton_decode import triton_available
from worker.lora.choice import kernel_problem, lora_ops
from worker.lora.ops import Group, grouped_torch

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


INTERPRETER_CHECKS: dict[str, Callable[[], None]] = {
    "startup-float32": partial(check_startup_step, torch.float32),
    "startup-float16": partial(check_startup_step, torch.float16),
    "long-segments": check_long_segments,
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
    with caplog.at_level(logging.ERROR, logger="worker.lora.choice"):
        assert lora_ops(torch.device("cuda", 7)) is grouped_torch  # no such device here: the check fails
    assert "the Triton kernels are off" in caplog.text


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
