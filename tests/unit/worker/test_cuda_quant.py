"""The weight-only layers' CUDA kernels (worker/quant/cuda_kernels.py): on a GPU (`make gpu-check`)
torch's int4 kernel and ``_scaled_mm`` against the dequantized weight's product; here, that a CPU
layer never takes them and the start-up words say nothing for a CPU model."""

from __future__ import annotations

import os

import pytest
import torch

from worker.quant.cuda_kernels import describe, fp8_problem, int4_fits, int4_problem, on_kernels
from worker.quant.fp8_activations import Fp8DynamicLinear, fp8_per_token
from worker.quant.layers import Fp8Linear, Int4Linear, quantize_linears

HAVE_CUDA = torch.cuda.is_available()
if os.environ.get("SLUICE_REQUIRE_CUDA") == "1" and not HAVE_CUDA:
    raise RuntimeError("SLUICE_REQUIRE_CUDA=1 but CUDA is missing: the CUDA tests cannot run")
needs_cuda = pytest.mark.skipif(not HAVE_CUDA, reason="needs a CUDA GPU (make gpu-check)")


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def test_on_the_cpu_no_layer_takes_a_cuda_kernel() -> None:
    assert int4_problem(torch.device("cpu")) == "cpu is not a CUDA device"
    assert fp8_problem(torch.device("cpu")) == "cpu is not a CUDA device"
    layer = Int4Linear.from_float(torch.randn(64, 128))
    assert not layer.on_cuda_kernel
    model = torch.nn.Sequential(torch.nn.Linear(128, 64))
    assert on_kernels(model) is None  # no quantized layer: the metric has no ``quant`` part
    quantize_linears(model, "int4")
    assert describe(model) is None  # a CPU model: the load line names its kernel already
    assert on_kernels(model) is False


def test_block_scaled_fp8_layers_are_named_as_upcast_not_as_misfits() -> None:
    """A block-FP8 checkpoint (Qwen3-8B-FP8 and the like) has no kernel on CUDA: the start-up words
    say so (before, they counted its layers as fp8 layers whose shapes did not fit ``_scaled_mm``),
    and the metric's ``quant`` part is 0 (a slower path serves)."""
    from worker.quant.fp8_blocks import Fp8BlockLinear

    weight = torch.randn(64, 64).to(torch.float8_e4m3fn)
    model = torch.nn.Sequential(Fp8BlockLinear(weight, torch.ones(2, 2), (32, 32)))
    assert describe(model, torch.device("cuda")) == (
        "1 fp8 layers with block scales upcast per product (no block-scaled kernel)"
    )
    assert on_kernels(model) is False


def test_the_int4_kernel_takes_only_the_shapes_it_packs() -> None:
    assert int4_fits(2048, 8192, 32) and int4_fits(256, 128, 128)
    assert not int4_fits(2048, 576, 32)  # inputs not a multiple of 128 (the default model's width)
    assert not int4_fits(2044, 2048, 32)  # outputs not a multiple of 8
    assert not int4_fits(2048, 2048, 16)  # a group the kernel does not take


@needs_cuda
@pytest.mark.parametrize("group", [32, 128])
def test_int4_on_cuda_matches_its_dequantized_weight(group: int) -> None:
    assert int4_problem(torch.device("cuda")) is None
    torch.manual_seed(0)
    weight = torch.randn(512, 1024, device="cuda")
    layer = Int4Linear.from_float(weight, torch.randn(512, device="cuda"), group)
    assert layer.on_cuda_kernel
    dequantized = layer.dequantized()
    assert relative_error(dequantized, weight) < 0.1  # 4-bit rounding
    for rows in (1, 7, 64):
        x = torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16)
        want = x.float() @ dequantized.t() + layer.bias
        assert relative_error(layer(x), want) < 1e-2


@needs_cuda
def test_fp8_on_cuda_is_scaled_mm_of_per_token_fp8_inputs() -> None:
    assert fp8_problem(torch.device("cuda")) is None
    torch.manual_seed(0)
    weight = torch.randn(512, 1024, device="cuda")
    for cls in (Fp8Linear, Fp8DynamicLinear):
        layer = cls.from_float(weight)
        assert layer.on_cuda_kernel
        for rows in (1, 7, 64):
            x = torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16)
            # The same rounding of the inputs, then the upcast weight's product in float32.
            want = fp8_per_token(x.float()) @ layer.dequantized().t()
            assert relative_error(layer(x), want) < 1e-2
        # float32 inputs keep the upcast path (the kernel writes bfloat16).
        x32 = torch.randn(3, 1024, device="cuda")
        assert layer(x32).dtype == torch.float32


@needs_cuda
def test_a_quantized_model_on_cuda_says_which_layers_run_a_kernel() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(1024, 512), torch.nn.Linear(576, 256)).cuda()
    quantize_linears(model, "int4")
    assert on_kernels(model) is False  # the second layer's shape does not fit
    assert (
        describe(model)
        == "1 of 2 int4 layers on torch's int4 kernel (tinygemm) (the others' shapes do not fit it)"
    )
