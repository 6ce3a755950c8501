"""The fused RMSNorm, SiLU·mul and rotary kernels (worker/model/fused.py) against the modules they
replace, in triton's CPU interpreter (a child process, see tests/triton_interpreter.py): each kernel
alone, then every tiny family through the paged runner with the kernels swapped in; here, the
fallbacks when triton fails, and each kernel compiled for an H100. The interpreter rounds to
bfloat16 by truncation, so exactness is checked in float16 and float32 here and in bfloat16 on a
GPU (tests/unit/worker/test_cuda_path.py)."""

from __future__ import annotations

import contextlib
import inspect
import logging
import sys
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import pytest
import torch
from torch import nn

from tests.tiny_families import eager_reference, tiny_config, tiny_model
from tests.triton_interpreter import interpreted_results, print_results, ptxas_available
from tests.unit.worker.test_model_families import BLOCK, check_against_reference, loaded, run_short_scenario
from worker.attention.triton_decode import triton_available
from worker.model import fused
from worker.model.runner import ModelRunner

pytestmark = pytest.mark.slow  # left out of make test-fast

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton is not installed")


def _random(*shape: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(sum(shape))
    return (torch.randn(shape, generator=generator) * scale).to(dtype)


def check_norm(dtype: torch.dtype, gemma: bool) -> None:
    """Both forms, on rows of a hidden state and on per-head rows (Qwen3's q/k norms)."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    module = (Gemma3RMSNorm(96) if gemma else LlamaRMSNorm(96, eps=1e-5)).to(dtype)
    with torch.no_grad():
        module.weight.copy_(_random(96, dtype=dtype))
    eps = module.eps if gemma else module.variance_epsilon
    for x in (_random(5, 96, dtype=dtype, scale=3.0), _random(2, 3, 4, 96, dtype=dtype)):
        got = fused.rms_norm(x, module.weight, eps, scale_in_fp32=gemma)
        want = module(x)
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
        else:  # float16: the same roundings, so equal but where the sums' order moves an ulp
            assert (got != want).float().mean() < 0.01
            torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)
    other = fused.rms_norm(x, module.weight, eps, scale_in_fp32=not gemma)
    assert not torch.allclose(other, module(x), atol=1e-2), "the two forms must differ"


def check_silu_mul(dtype: torch.dtype) -> None:
    gate, up = _random(7, 130, dtype=dtype, scale=4.0), _random(7, 130, dtype=dtype)
    want = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(fused.silu_mul(gate, up), want, atol=1e-3, rtol=1e-3)


def check_rotary(dtype: torch.dtype, head_dim: int) -> None:
    """Queries as attention modules lay them out (``[batch, tokens, heads, dim]`` transposed), as
    a decode step's rows (one token each) and as one prompt; an odd half (80 / 2) is masked."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    for batch, tokens in ((6, 1), (1, 9)):
        q = _random(batch, tokens, 4, head_dim, dtype=dtype).transpose(1, 2)
        k = _random(batch, tokens, 2, head_dim, dtype=dtype, scale=2.0).transpose(1, 2)
        angles = torch.rand((batch, tokens, head_dim // 2), generator=torch.Generator().manual_seed(1)) * 9
        cos = torch.cat([angles.cos()] * 2, -1).to(dtype)
        sin = torch.cat([angles.sin()] * 2, -1).to(dtype)
        want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
        got_q, got_k = fused.rotary(q, cos, sin), fused.rotary(k, cos, sin)
        assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


@contextlib.contextmanager
def own_rotary(model: nn.Module) -> Iterator[None]:
    """The modeling module's own rotary function while the reference runs (the fused one is put in
    the module, so a reference of the same family would use it too)."""
    module = sys.modules[type(model).__module__]
    current = module.__dict__.get("apply_rotary_pos_emb")
    if isinstance(current, fused._FusedRotary):
        module.__dict__["apply_rotary_pos_emb"] = current.own
    try:
        yield
    finally:
        module.__dict__["apply_rotary_pos_emb"] = current


# What each family gets: (norms fused, gated SiLU MLPs fused, rotary fused). One family per kind
# of difference: the interpreter runs every program in Python.
EXPECTED = {
    "llama": (True, True, True),
    "qwen3": (True, True, True),  # q/k norms over each head
    "gemma3_text": (True, False, True),  # the (1 + weight) form in float32; GELU MLPs
    "gpt_oss": (True, False, False),  # experts, and its own rotary (halves, not rotate_half)
    "phi3": (True, False, False),  # one gate_up projection; partial rotary
    "glm4_moe": (True, True, True),  # partial rotary: its angles are narrower, the function's own runs
    # Value norms without a scale (kept), GELU MLPs, a one-tensor rotary function (kept).
    "gemma4_text": (True, False, False),
}


def check_family(family: str) -> None:
    """The family through the paged runner with the kernels swapped in equals its eager forward
    (float32), and the kernels went where they apply."""
    model = tiny_model(tiny_config(family))
    reference = eager_reference(model)
    report = fused.fuse_model(model)
    assert report.failure is None, report.failure
    norms, mlps, rotary = EXPECTED[family]
    assert (report.norms > 0, report.mlps > 0, report.rotary > 0) == (norms, mlps, rotary), report.describe()
    runner = ModelRunner(loaded(model), num_blocks=100, block_size=BLOCK)
    sequences = run_short_scenario(runner)
    with own_rotary(reference):
        check_against_reference(reference, sequences)


INTERPRETER_CHECKS: dict[str, Callable[[], None]] = {
    **{
        f"norm-{name}-{form}": partial(check_norm, dtype, form == "gemma")
        for name, dtype in (("float32", torch.float32), ("float16", torch.float16))
        for form in ("llama", "gemma")
    },
    "silu_mul-float32": partial(check_silu_mul, torch.float32),
    "silu_mul-float16": partial(check_silu_mul, torch.float16),
    "rotary-float32-64": partial(check_rotary, torch.float32, 64),
    "rotary-float16-64": partial(check_rotary, torch.float16, 64),
    "rotary-float16-80": partial(check_rotary, torch.float16, 80),
    **{f"family-{family}": partial(check_family, family) for family in EXPECTED},
}


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, str | None]:
    return interpreted_results("tests.unit.worker.test_fused_kernels")


@needs_triton
@pytest.mark.parametrize("name", list(INTERPRETER_CHECKS))
def test_interpreted(name: str, interpreter_results: dict[str, str | None]) -> None:
    failure = interpreter_results[name]
    assert failure is None, failure


# ------------------------------------------------------------------ here: no launches


def tiny_llama() -> Any:
    return tiny_model(tiny_config("llama"))


def test_outside_cuda_nothing_is_fused() -> None:
    """CPU tensors without the interpreter: no class passes its check, the model is untouched."""
    model = tiny_llama()
    report = fused.fuse_model(model)
    assert (report.norms, report.mlps, report.rotary, report.failure) == (0, 0, 0, None)
    assert not any("forward" in vars(module) for module in model.modules())


def test_a_quantized_model_is_checked_like_a_float_one() -> None:
    """Quantized layers hold buffers, no parameters: the checks take the model's float dtype. Before,
    an attention module of quantized projections failed the whole fusion (``StopIteration``, seen on
    an H200 with --quantization int4 and fp8: those models ran unfused)."""
    from worker.quant.layers import quantize_linears

    model = tiny_llama()
    quantize_linears(model, "int8")
    report = fused.fuse_model(model)
    assert report.failure is None, report.describe()
    assert "LlamaAttention rotary" in report.kept  # CPU tensors: the kernels cannot launch here


def test_a_triton_failure_leaves_the_model_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_llama()
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.inference_mode():
        before = model(input_ids=ids).logits
    monkeypatch.setattr(fused, "_launchable", lambda *tensors: True)

    def broken(*args: Any, **kwargs: Any) -> torch.Tensor:
        raise RuntimeError("PassManager::run failed")

    for kernel in ("rms_norm", "silu_mul", "rotary"):
        monkeypatch.setattr(fused, kernel, broken)
    report = fused.fuse_model(model)
    assert report.failure == "RuntimeError: PassManager::run failed"
    assert not any("forward" in vars(module) for module in model.modules())
    monkeypatch.undo()
    with torch.inference_mode():
        assert torch.equal(model(input_ids=ids).logits, before)


@needs_triton
def test_a_failure_at_start_is_an_error_line_with_its_cost(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(fused, "fuse_model", lambda model: fused.FusedReport(failure="RuntimeError: boom"))
    with caplog.at_level(logging.ERROR, logger="worker.model.fused"):
        assert fused.fuse_for_serving(tiny_llama()) is False
    assert "RuntimeError: boom" in caplog.text and fused.UNFUSED_COST in caplog.text


def test_a_missing_triton_is_an_error_line(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(fused, "triton_available", lambda: False)
    with caplog.at_level(logging.ERROR, logger="worker.model.fused"):
        assert fused.fuse_for_serving(tiny_llama()) is False
    assert "triton is not installed" in caplog.text


def test_the_rotary_wrapper_falls_back_for_what_it_does_not_take() -> None:
    calls: list[tuple[Any, ...]] = []

    def own(*args: Any, **kwargs: Any) -> tuple[str, str]:
        calls.append(args)
        return "q", "k"

    wrapper = fused._FusedRotary(own)
    q = torch.zeros(1, 2, 3, 8)
    cos = torch.zeros(1, 3, 8)
    assert wrapper(q, q, cos, cos) == ("q", "k")  # CPU tensors: the kernel cannot launch
    assert wrapper(q, q, cos[..., :4], cos[..., :4]) == ("q", "k")  # partial rotary
    assert wrapper(q, q, cos, cos, 2) == ("q", "k")  # another unsqueeze_dim
    assert len(calls) == 3


@pytest.mark.skipif(not ptxas_available(), reason="triton's CUDA backend (ptxas) is not installed")
def test_a_gated_norm_called_with_its_gate_runs_its_own_form() -> None:
    """Granite 4's Mamba layers call their RMSNorm with a gate (``norm(x, gate)``); the start-up check
    compares one-argument calls only, so a call with more arguments is the module's own (before, the
    wrapper took one argument and Granite 4 failed to load on CUDA)."""
    from transformers.models.granitemoehybrid.modeling_granitemoehybrid import GraniteMoeHybridRMSNormGated

    norm = GraniteMoeHybridRMSNormGated(64, group_size=64)
    x, gate = _random(3, 64, dtype=torch.float32), _random(3, 64, dtype=torch.float32, scale=2.0)
    want = norm(x, gate)
    wrapped = fused._FusedNorm(norm, 1e-6, False, norm.forward)
    torch.testing.assert_close(wrapped(x, gate), want, atol=0, rtol=0)
    torch.testing.assert_close(wrapped(x, gate=gate), want, atol=0, rtol=0)


def test_the_kernels_compile_for_h100(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compiles (no launch) each kernel as a bf16 call of the 1.7B shape would on an H100."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from worker.model import fused_kernels as kernels

    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    cases: list[tuple[Any, dict[str, str], dict[str, Any], int]] = [
        (
            kernels.rms_norm_kernel,
            {"x_ptr": "*bf16", "weight_ptr": "*bf16", "out_ptr": "*bf16", "eps": "fp32"},
            {"BLOCK": 2048, "SCALE_IN_FP32": False},
            8,
        ),
        (
            kernels.silu_mul_kernel,
            {"gate_ptr": "*bf16", "up_ptr": "*bf16", "out_ptr": "*bf16"},
            {"BLOCK": 1024},
            4,
        ),
        (
            kernels.rotary_kernel,
            {"x_ptr": "*bf16", "cos_ptr": "*bf16", "sin_ptr": "*bf16", "out_ptr": "*bf16"},
            {"HALF_PAD": 32},
            1,
        ),
    ]
    for kernel, pointers, constants, warps in cases:
        names = inspect.signature(kernel.fn).parameters
        signature = {name: "constexpr" if name in constants else pointers.get(name, "i32") for name in names}
        compiled = triton.compile(
            ASTSource(kernel, signature, constexprs=constants),
            target=GPUTarget("cuda", 90, 32),
            options={"num_warps": warps},
        )
        assert compiled.asm["cubin"], kernel.fn.__name__


if __name__ == "__main__":  # the child process of `interpreter_results`
    print_results(INTERPRETER_CHECKS)
