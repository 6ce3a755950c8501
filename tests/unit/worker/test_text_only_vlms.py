"""Vision-language checkpoints served for text alone (worker/model/text_only.py ``TEXT_ONLY``: Qwen3.5,
Qwen3.5-MoE, Gemma 4): a tiny multimodal checkpoint saved with save_pretrained, loaded through
``load_model`` and the ModelRunner, runs the hybrid scenario (chunks, decode rows, mixed steps, a
restart) equal to transformers' eager forward of the same checkpoint; an int8 load quantizes it;
image parts are refused naming the part; the load says in one line that the vision tower is not
used (docs/models.md)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import transformers

from tests.tiny_vlms import TEXT_ONLY_ARCHITECTURES, build_text_only_vlm
from tests.unit.worker.test_hybrid_families import check_against_reference, run_scenario
from worker.errors import InvalidRequest
from worker.model.loader import LoadedModel, ModelLoadError, load_model
from worker.model.runner import ModelRunner
from worker.model.vision import vision_spec
from worker.prompts.family import FamilyProfile
from worker.prompts.images import ImageData
from worker.prompts.prompt import ChatMessage, ChatPrompt
from worker.server import prompt_renderer

pytestmark = pytest.mark.slow  # left out of make test-fast

BLOCK = 4
PNG = bytes.fromhex("89504e470d0a1a0a")  # refused before it is read


@pytest.fixture(scope="module", params=TEXT_ONLY_ARCHITECTURES)
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_text_only_vlm(request.param, tmp_path_factory.mktemp(request.param) / "model")


def load(folder: Path) -> LoadedModel:
    return load_model(str(folder), device="cpu", dtype="float32", quantization="none")


def test_the_checkpoint_loads_as_it_is_and_logs_its_unused_tower(
    checkpoint: Path, caplog: pytest.LogCaptureFixture
) -> None:
    loaded = load(checkpoint)
    assert type(loaded.model).__name__.endswith("ForConditionalGeneration")
    assert loaded.processor is None  # no image processing is loaded (none is saved either)
    with caplog.at_level(logging.INFO, logger="worker.model.text_only"):
        runner = ModelRunner(loaded, num_blocks=8, block_size=BLOCK, max_sequences=2)
    lines = [r.getMessage() for r in caplog.records if "not used" in r.getMessage()]
    assert len(lines) == 1 and "the vision tower is loaded but not used" in lines[0], lines
    assert runner.vision is None
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


def test_image_parts_are_refused_naming_the_part(checkpoint: Path) -> None:
    loaded = load(checkpoint)
    renderer = prompt_renderer(loaded, FamilyProfile("unknown"))
    assert not renderer.accepts_images  # ListModels' accepts_images: /v1/models shows none
    chat = ChatPrompt(
        (
            ChatMessage("user", "Hello."),
            ChatMessage("user", None, parts=("Look:", ImageData(PNG, "image/png"))),
        )
    )
    with pytest.raises(InvalidRequest) as refused:
        renderer.render(chat)
    assert refused.value.param == "messages[1].parts"
    kind = loaded.model.config.model_type
    assert refused.value.message.startswith(
        f"messages[1].parts: this model's images are not served yet ({kind}:"
    ), refused.value.message


def test_another_unserved_vision_language_architecture_is_still_refused_at_load() -> None:
    with pytest.raises(ModelLoadError, match=r"llava_next.*does not serve yet.*for text alone gemma4"):
        vision_spec(transformers.LlavaNextConfig())
