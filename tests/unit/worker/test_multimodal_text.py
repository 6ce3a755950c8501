"""The text of the multimodal Qwen3.5, Qwen3.5-MoE and Gemma 4 checkpoints: a tiny checkpoint with
its processor, loaded through ``load_model`` and the ModelRunner (its vision encoder beside the pools),
runs the hybrid scenario's kinds of step (chunks, decode rows, a restart) equal to transformers'
eager forward of the same checkpoint; an int8 load quantizes it (docs/models.md). Images:
test_hybrid_vlms.py."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from tests.tiny_vlms import MULTIMODAL_HYBRIDS
from tests.unit.worker.test_hybrid_families import check_against_reference, run_short_scenario
from worker.model.loader import LoadedModel, ModelLoadError, load_model
from worker.model.runner import ModelRunner
from worker.model.vision import vision_spec

pytestmark = pytest.mark.slow  # left out of make test-fast

BLOCK = 4


@dataclass
class Loaded:
    """A family's checkpoint, loaded once in float for the module, and the tokenizer reads that took."""

    checkpoint: Path
    loaded: LoadedModel
    tokenizer_reads: list[str]


def tokenizer_reads(patch: pytest.MonkeyPatch, loaded: Any = None) -> list[str]:
    """The folders ``AutoTokenizer.from_pretrained`` reads from now on (under ``patch``); with
    ``loaded``, each read answers that tokenizer of the same folder instead of parsing its
    150k-262k vocabulary again (what is counted is the reads)."""
    reads: list[str] = []
    read = transformers.AutoTokenizer.from_pretrained

    def counted(*args: Any, **kwargs: Any) -> Any:
        reads.append(str(args[0]))
        return read(*args, **kwargs) if loaded is None else loaded

    patch.setattr(transformers.AutoTokenizer, "from_pretrained", counted)
    return reads


@pytest.fixture(scope="module", params=MULTIMODAL_HYBRIDS)
def family(request: pytest.FixtureRequest, tiny_vlm: Callable[[str], Path]) -> Iterator[Loaded]:
    checkpoint = tiny_vlm(request.param)
    with pytest.MonkeyPatch.context() as patch:
        reads = tokenizer_reads(patch)
        loaded = load_model(str(checkpoint), device="cpu", dtype="float32", quantization="none")
    yield Loaded(checkpoint, loaded, reads)


def test_the_checkpoint_loads_with_its_processor_and_vision_encoder(family: Loaded) -> None:
    """...and its tokenizer is read once: the images-only processor (these want a video processor,
    which needs torchvision) is built around the model's own tokenizer."""
    loaded = family.loaded
    assert type(loaded.model).__name__.endswith("ForConditionalGeneration")
    assert loaded.processor is not None and loaded.processor.tokenizer is loaded.tokenizer
    assert len(family.tokenizer_reads) == 1, family.tokenizer_reads
    runner = ModelRunner(loaded, num_blocks=8, block_size=BLOCK, max_sequences=2)
    assert runner.vision is not None
    assert (runner.states is not None) == loaded.model.config.model_type.startswith("qwen3_5")


def test_the_text_scenario_equals_the_checkpoints_eager_forward(family: Loaded) -> None:
    reference = transformers.AutoModelForImageTextToText.from_pretrained(
        str(family.checkpoint), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    runner = ModelRunner(family.loaded, num_blocks=100, block_size=BLOCK, max_sequences=8)
    check_against_reference(reference, run_short_scenario(runner))


def test_an_int8_load_reads_the_checkpoint_in_float_then_quantizes(
    family: Loaded, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The direct quantized load builds a causal LM, whose weight names are not the multimodal
    checkpoint's: such a checkpoint loads in float (its tokenizer read once), then its linear
    layers are quantized."""
    reads = tokenizer_reads(monkeypatch, family.loaded.tokenizer)
    quantized = load_model(str(family.checkpoint), device="cpu", dtype="float32", quantization="int8")
    assert type(quantized.model).__name__.endswith("ForConditionalGeneration")
    assert reads == [str(family.checkpoint)]
    float_model = family.loaded.model
    ids = torch.tensor([[5, 9, 100, 7, 3, 44]])
    with torch.inference_mode():
        got, want = quantized.model(input_ids=ids).logits[0], float_model(input_ids=ids).logits[0]
    # int8 moves these tiny random hybrids' logits by 4-12 % (bfloat16-rounded activations, carried on
    # by the states); weights not read from the checkpoint would move them by far more.
    assert float((got - want).norm() / want.norm()) < 0.25


def test_another_unserved_vision_language_architecture_is_still_refused_at_load() -> None:
    with pytest.raises(ModelLoadError, match=r"llava_next.*does not serve yet.*gemma4, idefics3"):
        vision_spec(transformers.LlavaNextConfig())
