"""MoE experts and routers on the weight-only kernels (worker/quant/moe.py): a token's output is
the same bits in any batch, and equals the float block holding the same (dequantized) weights."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.tiny_families import tiny_config, tiny_model
from tests.unit.worker.test_paged_runner import loaded
from worker.model.runner import check_batch_invariant
from worker.quant.layers import cpu_kernels_available, quantize_linears, row_invariant_linears
from worker.quant.moe import RowInvariantExperts, RowInvariantRouter

pytestmark = pytest.mark.skipif(not cpu_kernels_available(), reason="no int4/int8 CPU kernels in this torch")

MOE_FAMILIES = ["gpt_oss", "qwen3_moe", "mixtral", "granitemoe", "glm4_moe"]


def moe_block(model: torch.nn.Module) -> torch.nn.Module:
    """The last decoder layer's block holding the experts (glm4_moe's first layer is dense)."""
    return next(m for m in model.model.layers[-1].modules() if hasattr(m, "experts"))


def run(block: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = block(hidden)
    return out[0] if isinstance(out, tuple) else out


def converted(family: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The family's MoE block on int4 linear layers (glm4_moe's shared experts), before and after
    the batch-invariant check put its experts and router on the kernels."""
    model = tiny_model(tiny_config(family))
    quantize_linears(model, "int4")
    before = copy.deepcopy(moe_block(model))
    row_invariant_linears(before)  # the same linear layers: no float copies for batches
    check_batch_invariant(loaded(model))
    return before, moe_block(model)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_a_token_gets_the_same_bits_in_any_batch(family: str) -> None:
    """The float block's BLAS products round a token by how many tokens chose its expert; the
    converted block's do not."""
    _, block = converted(family)
    torch.manual_seed(1)
    hidden = torch.randn(1, 13, 64)
    together = run(block, hidden)
    for i in range(13):
        assert torch.equal(run(block, hidden[:, i : i + 1])[0, 0], together[0, i]), f"token {i}"
        assert torch.equal(run(block, hidden[:, : i + 1])[0, i], together[0, i]), f"first {i + 1} tokens"


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_the_converted_block_computes_what_the_float_block_does(family: str) -> None:
    """Against the float block holding the quantized layers' own weights (each layout: gpt-oss's
    transposed, interleaved gate/up with biases; the others' concatenated ones), within the
    bfloat16 rounding of the kernels' activations."""
    before, block = converted(family)
    experts = next(m for m in block.modules() if isinstance(m, RowInvariantExperts))
    router = next(m for m in block.modules() if isinstance(m, RowInvariantRouter))
    float_experts = next(m for m in before.modules() if hasattr(m, "is_transposed"))
    first = "gate_up_proj" if experts.has_gate else "up_proj"
    with torch.no_grad():
        for name, layers in ((first, experts.up), ("down_proj", experts.down)):
            weights = torch.stack([layer.dequantized() for layer in layers])  # [experts, out, in]
            getattr(float_experts, name).copy_(
                weights.transpose(1, 2) if float_experts.is_transposed else weights
            )
        float_router = next(m for m in before.modules() if type(m) is type(router.router))
        float_router.weight.copy_(router.logits.dequantized())
    torch.manual_seed(2)
    hidden = torch.randn(1, 9, 64)
    want, got = run(before, hidden), run(block, hidden)
    assert ((got - want).norm() / want.norm()).item() < 0.03
