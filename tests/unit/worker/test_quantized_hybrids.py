"""``--quantization`` on hybrid models (tiny Qwen3.5, Granite 4 hybrid and LFM2 checkpoints): int8
and int4 loaded as the worker loads them, fp8 layers on their generic path (the CPU refuses fp8 at
load; CUDA quantizes the float model with the same call); the mixers' projections are quantized,
their convolutions and states stay float. Prompt logprobs stay within each format's weight error
bound of the float model's (test_quantization.py's bounds)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer

from tests.tiny_families import COMMON, tiny_config, tiny_model
from tests.unit.worker.test_model_families import loaded
from worker.model.loader import load_model
from worker.model.runner import ModelRunner
from worker.quant.layers import Fp8Linear, cpu_kernels_available, quantize_linears

pytestmark = [
    pytest.mark.skipif(not cpu_kernels_available(), reason="no CPU int8/int4 kernels in this torch"),
    pytest.mark.slow,  # left out of make test-fast
]

FAMILIES = ["qwen3_5_text", "granitemoehybrid", "lfm2"]
# test_quantization.py's bound on a weight's relative error in each format. Weights at the scale of
# real checkpoints (transformers' initializer_range 0.02): the tests' usual 0.2 makes the tiny
# random Qwen3.5 amplify rounding tenfold (int8 moves its logprobs by 34 %, a Llama's by 4 %).
BOUNDS = {"int8": 0.01, "int4": 0.1, "fp8": 0.07}
PROMPT = [(3 + 7 * i) % COMMON["vocab_size"] for i in range(40)]


def config(family: str) -> Any:
    return tiny_config(family, initializer_range=0.02)


@pytest.fixture(scope="module")
def checkpoints(
    tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path
) -> dict[str, tuple[Path, torch.Tensor]]:
    """Each family saved as a checkpoint (with the default model's tokenizer, which the loader
    reads), and the float model's prompt logprobs."""
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    found = {}
    for family in FAMILIES:
        folder = tmp_path_factory.mktemp(family)
        model = tiny_model(config(family))
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        found[family] = (folder, prompt_logprobs(loaded(model)))
    return found


def prompt_logprobs(loaded: Any) -> torch.Tensor:
    """The prompt's logprobs as the worker scores them (``echo``, ``max_tokens`` 0)."""
    runner = ModelRunner(loaded, num_blocks=16, block_size=16)
    return torch.tensor([entry.logprob for entry in runner.score(PROMPT, 0)])


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_quantized_hybrid_checkpoint_scores_prompts_like_float(
    checkpoints: dict[str, tuple[Path, torch.Tensor]], family: str, scheme: str
) -> None:
    """Loaded with ``--quantization`` (Granite 4's checkpoint names its fused experts otherwise than
    its modules: it is read in float, then quantized)."""
    folder, want = checkpoints[family]
    quantized = load_model(str(folder), device="cpu", dtype="float32", quantization=scheme)
    assert quantized.quantization == scheme
    assert not any(type(m) is torch.nn.Linear for m in quantized.model.modules())
    assert relative_error(prompt_logprobs(quantized), want) < BOUNDS[scheme]


@pytest.mark.parametrize("family", FAMILIES)
def test_fp8_layers_in_a_hybrid_score_prompts_like_float(family: str) -> None:
    model = tiny_model(config(family))
    want = prompt_logprobs(loaded(model))
    assert quantize_linears(model, "fp8") > 0
    assert any(isinstance(m, Fp8Linear) for m in model.modules())
    assert relative_error(prompt_logprobs(loaded(model)), want) < BOUNDS["fp8"]
