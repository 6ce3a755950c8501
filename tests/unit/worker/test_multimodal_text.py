"""The text of the multimodal Qwen3.5, Qwen3.5-MoE and Gemma 4 checkpoints: a tiny checkpoint with
its processor, loaded through ``load_model`` and the ModelRunner (its vision encoder beside the pools),
runs the hybrid scenario (chunks, decode rows, mixed steps, a restart) equal to transformers' eager
forward of the same checkpoint; an int8 load quantizes it (docs/models.md). Their images:
test_hybrid_vlms.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from tests.tiny_vlms import MULTIMODAL_HYBRIDS, build_tiny_vlm
from tests.unit.worker.test_hybrid_families import check_against_reference, run_scenario
from worker.model.loader import LoadedModel, ModelLoadError, load_model
from worker.model.runner import ModelRunner
from worker.model.vision import vision_spec

pytestmark = pytest.mark.slow  # left out of make test-fast

BLOCK = 4


@pytest.fixture(scope="module", params=MULTIMODAL_HYBRIDS)
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_vlm(request.param, tmp_path_factory.mktemp(request.param) / "model")


def load(folder: Path) -> LoadedModel:
    return load_model(str(folder), device="cpu", dtype="float32", quantization="none")


def test_the_checkpoint_loads_with_its_processor_and_vision_encoder(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """...and its tokenizer is read once: the images-only processor (these want a video processor,
    which needs torchvision) is built around the model's own tokenizer."""
    reads: list[str] = []
    read = transformers.AutoTokenizer.from_pretrained

    def counted(*args: Any, **kwargs: Any) -> Any:
        reads.append(str(args[0]))
        return read(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", counted)
    loaded = load(checkpoint)
    assert type(loaded.model).__name__.endswith("ForConditionalGeneration")
    assert loaded.processor is not None and loaded.processor.tokenizer is loaded.tokenizer
    assert len(reads) == 1, reads
    runner = ModelRunner(loaded, num_blocks=8, block_size=BLOCK, max_sequences=2)
    assert runner.vision is not None
    assert (runner.states is not None) == loaded.model.config.model_type.startswith("qwen3_5")


def test_the_text_scenario_equals_the_checkpoints_eager_forward(checkpoint: Path) -> None:
    loaded = load(checkpoint)
    reference = transformers.AutoModelForImageTextToText.from_pretrained(
        str(checkpoint), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    runner = ModelRunner(loaded, num_blocks=100, block_size=BLOCK, max_sequences=8)
    check_against_reference(reference, run_scenario(runner))


def test_an_int8_load_reads_the_checkpoint_in_float_then_quantizes(checkpoint: Path) -> None:
    """The direct quantized load builds a causal LM, whose weight names are not the multimodal
    checkpoint's: such a checkpoint loads in float, then its linear layers are quantized."""
    quantized = load_model(str(checkpoint), device="cpu", dtype="float32", quantization="int8")
    assert type(quantized.model).__name__.endswith("ForConditionalGeneration")
    float_model = load(checkpoint).model
    ids = torch.tensor([[5, 9, 100, 7, 3, 44]])
    with torch.inference_mode():
        got, want = quantized.model(input_ids=ids).logits[0], float_model(input_ids=ids).logits[0]
    # int8 moves these tiny random hybrids' logits by 4-12 % (bfloat16-rounded activations, carried on
    # by the states); weights not read from the checkpoint would move them by far more.
    assert float((got - want).norm() / want.norm()) < 0.25


def test_another_unserved_vision_language_architecture_is_still_refused_at_load() -> None:
    with pytest.raises(ModelLoadError, match=r"llava_next.*does not serve yet.*gemma4, idefics3"):
        vision_spec(transformers.LlavaNextConfig())
