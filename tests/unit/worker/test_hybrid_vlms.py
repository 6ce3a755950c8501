"""Images of the multimodal hybrid and Gemma 4 checkpoints (Qwen3.5, Qwen3.5-MoE, Gemma 4): a tiny
random checkpoint with its processor, loaded through ``load_model``, its chat with an image rendered
by the worker's renderer and run by the ModelRunner in chunks (one-token chunks before and after the
image, the image in one chunk) gives every position's logprobs as transformers' eager float32 forward
of the same processor output within 5e-3, and greedy decode rows write ``generate``'s tokens."""

from __future__ import annotations

import dataclasses
import io
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from PIL import Image

from worker.model.loader import LoadedModel, load_model, load_processor
from worker.model.runner import ModelRunner
from worker.model.step_inputs import Work, work_of
from worker.prompts.family import FamilyProfile
from worker.prompts.images import ImageData
from worker.prompts.prompt import ChatMessage, ChatPrompt
from worker.server import prompt_renderer
from worker.types import LoraHandle, PromptImage

pytestmark = pytest.mark.slow  # left out of make test-fast

BLOCK = 4
GREEDY = 8
ATOL = 5e-3


@dataclass
class Served:
    arch: str
    loaded: LoadedModel
    runner: ModelRunner
    reference: Any
    processor: Any


# Qwen3.5 MoE shares Qwen3.5's vision path (its text scenario: test_multimodal_text.py).
@pytest.fixture(scope="module", params=["qwen3_5", "gemma4"])
def served(request: pytest.FixtureRequest, tiny_vlm: Callable[[str], Path]) -> Iterator[Served]:
    folder = tiny_vlm(request.param)
    loaded = load_model(str(folder), device="cpu", dtype="float32", quantization="none")
    runner = ModelRunner(loaded, num_blocks=64, block_size=BLOCK, max_sequences=2)
    reference = transformers.AutoModelForImageTextToText.from_pretrained(
        str(folder), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    yield Served(request.param, loaded, runner, reference, load_processor(str(folder), loaded.tokenizer))


@dataclass
class Planned:
    """What ``work_of`` reads of a sequence (the scheduler's ``SeqState``)."""

    tokens: list[int]
    images: tuple[PromptImage, ...]
    table: list[int]
    computed: int = 0
    generated: int = 0
    state_slot: int = 0
    lora: LoraHandle | None = None
    logits: dict[int, torch.Tensor] = field(default_factory=dict)  # position -> its logits

    def step(self, runner: ModelRunner, count: int) -> None:
        item: Work = work_of(self, count)
        item = dataclasses.replace(item, sample=True)  # every chunk's last logits, for the check
        self.logits[self.computed + count - 1] = runner.execute([item])[0].clone()
        self.computed += count


def noise(seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (30, 40, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


def rendered(served: Served, image: Image.Image) -> tuple[list[int], tuple[PromptImage, ...]]:
    renderer = prompt_renderer(served.loaded, FamilyProfile("unknown"))
    assert renderer.accepts_images  # ListModels' accepts_images: /v1/models advertises images
    chat = ChatPrompt((ChatMessage("user", None, parts=("Look at", ImageData(png(image)), "now.")),))
    ids, _, images = renderer.render_with_images(chat)
    return list(ids), images


def test_the_loaded_processor_holds_the_loaded_tokenizer_and_its_folders_settings(
    served: Served, tiny_vlm: Callable[[str], Path]
) -> None:
    """``load_model``'s processor (images only: both want a video processor) is built around the
    tokenizer it loaded, with processor_config.json's settings as ``from_pretrained`` applies them
    (Gemma 4's ``image_seq_length`` 70, not its class default 280)."""
    config = json.loads((tiny_vlm(served.arch) / "processor_config.json").read_text())
    del config["processor_class"]
    processor = served.loaded.processor
    assert processor.tokenizer is served.loaded.tokenizer and processor.video_processor is None
    assert {key: getattr(processor, key) for key in config} == config


def reference_inputs(served: Served, image: Image.Image) -> Any:
    content = [{"type": "text", "text": "Look at"}, {"type": "image", "image": image}]
    return served.processor.apply_chat_template(
        [{"role": "user", "content": [*content, {"type": "text", "text": "now."}]}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
    )


def test_a_prompt_with_an_image_scores_and_decodes_like_transformers(served: Served) -> None:
    image = noise(1)
    ids, images = rendered(served, image)
    inputs = reference_inputs(served, image)
    assert ids == inputs["input_ids"][0].tolist() and len(images) == 1
    start, end = images[0].start, images[0].end
    sequence = Planned(list(ids), images, list(range(-(-(len(ids) + GREEDY) // BLOCK))))
    for _ in range(start):  # one-token chunks before the image (decode rows at prompt positions)
        sequence.step(served.runner, 1)
    sequence.step(served.runner, end - start)  # the image in one chunk
    while sequence.computed < len(ids):
        sequence.step(served.runner, 1)
    with torch.inference_mode():
        want = torch.log_softmax(served.reference(**inputs).logits[0].float(), -1)
        out = served.reference.generate(**inputs, max_new_tokens=GREEDY, do_sample=False)
    for position, logits in sequence.logits.items():
        got = torch.log_softmax(logits, -1)
        torch.testing.assert_close(got, want[position], atol=ATOL, rtol=0, msg=f"position {position}")
    expected = out[0, len(ids) :].tolist()
    for _ in range(GREEDY):  # greedy decode rows (M-RoPE: the image's offset added)
        sequence.tokens.append(int(sequence.logits[sequence.computed - 1].argmax()))
        sequence.step(served.runner, 1)
    assert sequence.tokens[len(ids) :] == expected
    other = reference_inputs(served, Image.new("RGB", image.size, (250, 20, 20)))  # the same prompt
    with torch.inference_mode():
        moved = torch.log_softmax(served.reference(**other).logits[0, -1].float(), -1)
    assert float((moved - want[-1]).abs().max()) > 20 * ATOL  # the image reaches the model
