"""Images through a real worker over real gRPC, per served vision-language architecture: a tiny
random model's greedy output with one and with two images equals transformers' ``generate`` on the
same processor output; a repeated image hits the prefix cache, a changed pixel misses; bad images
and a text-only model are refused with INVALID_ARGUMENT naming the part. Through a real edge in
front of each: an ``image_url`` data-URL part decodes like ``generate``, its second turn reports the
image as cached prompt tokens, and a loopback image URL is a 400."""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from sluice.status import read_details
from sluice.v1 import worker_pb2 as pb
from sluice.v1 import worker_pb2_grpc as pb_grpc
from tests.images import data_url
from tests.processes import EdgeProcess, WorkerProcess
from tests.tiny_vlms import tiny_processor

pytestmark = pytest.mark.integration

GREEDY_TOKENS = 8
# Small blocks, so cached prefixes end near the images; a small prefill budget, so prompts are
# computed in chunks whose ends fall inside the images' placeholder runs (the scheduler moves them).
WORKER_FLAGS = ["--kv-block-size", "4", "--max-prefill-tokens", "8", "--max-batch-tokens", "4096"]


def noise(seed: int, size: tuple[int, int] = (40, 30)) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def encoded(image: Image.Image, fmt: str = "PNG") -> bytes:
    out = io.BytesIO()
    image.save(out, fmt)
    return out.getvalue()


@dataclass
class Served:
    arch: str
    stub: pb_grpc.WorkerStub
    processor: Any  # transformers' (AutoProcessor's; Qwen2-VL's images-only: tests/tiny_vlms.py)
    model: Any
    edge_url: str
    folder: Path | None = None


@pytest.fixture(scope="module", params=["llava", "gemma3", "idefics3", "qwen2_vl", "qwen2_5_vl"])
def served(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tiny_vlm: Callable[[str], Path]
) -> Iterator[Served]:
    from transformers import AutoModelForImageTextToText

    arch = request.param
    folder = tiny_vlm(arch)
    processor = tiny_processor(folder)
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    logs = tmp_path_factory.mktemp(f"vlm-{arch}-log")
    with (
        WorkerProcess(cache_dir=logs, log_dir=logs, model=str(folder), extra=WORKER_FLAGS) as worker,
        EdgeProcess([worker.address], log_dir=logs, extra=["--allow-image-urls"]) as edge,
        grpc.insecure_channel(worker.address) as channel,
    ):
        yield Served(arch, pb_grpc.WorkerStub(channel), processor, model, edge.base_url, folder)


def chat(*parts: str | bytes, max_tokens: int = GREEDY_TOKENS) -> pb.GenerateRequest:
    content = [
        pb.ContentPart(text=part) if isinstance(part, str) else pb.ContentPart(image=pb.ImageInput(data=part))
        for part in parts
    ]
    return pb.GenerateRequest(
        chat=pb.ChatInput(messages=[pb.ChatMessage(role="user", parts=content)]),
        sampling=pb.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0),
        return_token_ids=True,
    )


def deltas(events: list[pb.GenerateResponse]) -> list[Any]:
    """The text deltas in order: content, and reasoning (Qwen3.5's template opens a thinking block)."""
    return [
        getattr(e, e.WhichOneof("event")) for e in events if e.WhichOneof("event") in ("content", "reasoning")
    ]


def generated(events: list[pb.GenerateResponse]) -> list[int]:
    return [token for delta in deltas(events) for token in delta.token_ids]


def logprobs(events: list[pb.GenerateResponse]) -> torch.Tensor:
    return torch.tensor([entry.logprob for delta in deltas(events) for entry in delta.logprobs])


def processed(served: Served, *parts: str | Image.Image) -> Any:
    """The processor's output for a one-message chat of ``parts`` (its ids, pixels and grids)."""
    content = [
        {"type": "text", "text": part} if isinstance(part, str) else {"type": "image", "image": part}
        for part in parts
    ]
    return served.processor.apply_chat_template(
        [{"role": "user", "content": content}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
    )


def prompt_of(served: Served, *parts: str | Image.Image) -> list[int]:
    """transformers' prompt ids for the message (no forward: where a test needs only those)."""
    return list(processed(served, *parts)["input_ids"][0].tolist())


def reference(served: Served, *parts: str | Image.Image) -> tuple[list[int], list[int], torch.Tensor]:
    """transformers' prompt ids, greedy tokens and their logprobs for the same message."""
    inputs = processed(served, *parts)
    with torch.no_grad():
        out = served.model.generate(
            **inputs,
            max_new_tokens=GREEDY_TOKENS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    prompt = inputs["input_ids"][0].tolist()
    tokens = out.sequences[0, len(prompt) :]
    chosen = torch.stack(
        [torch.log_softmax(step[0].float(), -1)[t] for step, t in zip(out.logits, tokens, strict=True)]
    )
    return prompt, tokens.tolist(), chosen


def image_span(served: Served, prompt: list[int]) -> tuple[int, int]:
    """The first and past-the-last placeholder of a one-image prompt (an Idefics3 image's tiles
    and their markers included)."""
    token = served.model.config.image_token_id
    positions = [i for i, t in enumerate(prompt) if t == token]
    return positions[0], positions[-1] + 1


def test_model_lists_that_it_accepts_images(served: Served) -> None:
    assert served.stub.ListModels(pb.ListModelsRequest()).models[0].accepts_images


def test_the_loaders_processor_reuses_the_tokenizer_and_equals_transformers_own(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker's processor (``load_processor`` around the tokenizer the loader already has) loads
    no tokenizer again, holds the one given, and is the reference processor's equal: its class,
    its own settings (processor_config.json's among them), its image processor's, and its ids and
    pixels for a chat with an image and text."""
    from transformers import PreTrainedTokenizerBase

    from worker.model.loader import load_processor

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the processor loaded the tokenizer again")

    assert served.folder is not None
    reference, tokenizer = served.processor, served.processor.tokenizer
    with monkeypatch.context() as patched:
        patched.setattr(PreTrainedTokenizerBase, "from_pretrained", classmethod(refuse))
        built = load_processor(str(served.folder), tokenizer)
    assert built.tokenizer is tokenizer
    parts = ("tokenizer", "image_processor", "video_processor", "feature_extractor")
    settings = {key: value for key, value in vars(reference).items() if key not in parts}
    assert type(built) is type(reference) or type(built).__name__ == type(reference).__name__ == "ImagesOnly"
    assert {key: value for key, value in vars(built).items() if key not in parts} == settings
    assert built.image_processor.to_dict() == reference.image_processor.to_dict()
    config = json.loads((served.folder / "processor_config.json").read_text())
    assert {key: getattr(built, key) for key in config if key != "processor_class"} == {
        key: value for key, value in config.items() if key != "processor_class"
    }
    image = noise(13)
    want, got = (
        processed(served, "Look:", image, "now."),
        processed(replace(served, processor=built), "Look:", image, "now."),
    )
    assert want.keys() == got.keys() and all(torch.equal(want[key], got[key]) for key in want)


def test_one_image_decodes_like_transformers(served: Served) -> None:
    image = noise(1)
    prompt, expected, expected_logprobs = reference(served, image, "What is in this picture?")
    events = list(served.stub.Generate(chat(encoded(image), "What is in this picture?")))
    assert events[0].started.prompt_tokens == len(prompt)
    assert generated(events) == expected
    # Closer than a wrong attention mask over the image (Gemma 3's bidirectional block) would be.
    assert torch.allclose(logprobs(events), expected_logprobs, atol=2e-3, rtol=0)
    other = reference(served, noise(2), "What is in this picture?")[1]
    assert other != expected  # the image reaches the model


def test_two_images_decode_like_transformers(served: Served) -> None:
    first, second = noise(3), noise(4, (24, 48))
    prompt, expected, expected_logprobs = reference(served, "Compare", first, "with", second, "please.")
    events = list(served.stub.Generate(chat("Compare", encoded(first), "with", encoded(second), "please.")))
    assert events[0].started.prompt_tokens == len(prompt)
    assert generated(events) == expected
    assert torch.allclose(logprobs(events), expected_logprobs, atol=2e-3, rtol=0)


def test_a_repeated_image_is_cached_and_a_changed_pixel_is_not(served: Served) -> None:
    image = noise(5)
    prompt = prompt_of(served, "Describe", image, "briefly.")
    start, end = image_span(served, prompt)
    first = list(served.stub.Generate(chat("Describe", encoded(image), "briefly.", max_tokens=1)))
    again = list(served.stub.Generate(chat("Describe", encoded(image), "briefly.", max_tokens=1)))
    assert first[-1].usage.cached_tokens <= start  # nothing of this image was cached before
    assert again[-1].usage.cached_tokens >= end  # the cached prefix covers the whole image
    changed = image.copy()
    changed.putpixel((7, 7), tuple(255 - v for v in image.getpixel((7, 7))))
    other = list(served.stub.Generate(chat("Describe", encoded(changed), "briefly.", max_tokens=1)))
    assert other[-1].usage.cached_tokens <= start


def test_a_cached_prefix_that_ends_inside_an_image_decodes_like_transformers(served: Served) -> None:
    """The second prompt shares the first's image but not the text after it, and its cached blocks
    end inside the image: the rest of the image is computed from its features' later rows."""
    image = noise(10)
    for before in ("Hi", "Hi there", "Hi there you", "Well hi there you"):
        first = prompt_of(served, before, image, "Describe it.")
        prompt = prompt_of(served, before, image, "Name its colours.")
        start, end = image_span(served, prompt)
        common = next(i for i, (a, b) in enumerate(zip(first, prompt, strict=False)) if a != b)
        block = 4  # --kv-block-size
        if start < common // block * block < end:
            break
    else:
        pytest.skip("no prefix puts a block boundary inside the image")
    expected, expected_logprobs = reference(served, before, image, "Name its colours.")[1:]
    list(served.stub.Generate(chat(before, encoded(image), "Describe it.", max_tokens=1)))
    events = list(served.stub.Generate(chat(before, encoded(image), "Name its colours.")))
    assert start < events[-1].usage.cached_tokens < end
    assert generated(events) == expected
    assert torch.allclose(logprobs(events), expected_logprobs, atol=2e-3, rtol=0)


@pytest.mark.parametrize(
    ("data", "why"),
    [(b"not an image", "cannot be decoded"), (encoded(noise(6), "BMP"), "unsupported image format")],
)
def test_bad_image_bytes_are_refused_naming_the_part(served: Served, data: bytes, why: str) -> None:
    with pytest.raises(grpc.RpcError) as info:
        list(served.stub.Generate(chat("Look:", data)))
    details = read_details(info.value)
    assert details.code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.param == "messages[0].parts[1]" and why in details.message


def test_a_gif_is_read_from_its_first_frame(served: Served) -> None:
    frames = [noise(7), noise(8)]
    out = io.BytesIO()
    frames[0].save(out, "GIF", save_all=True, append_images=frames[1:])
    first_frame = Image.open(io.BytesIO(out.getvalue())).convert("RGB")
    expected = reference(served, first_frame, "What is it?")[1]
    assert generated(list(served.stub.Generate(chat(out.getvalue(), "What is it?")))) == expected


def test_a_text_only_model_refuses_image_parts(default_worker: WorkerProcess) -> None:
    with grpc.insecure_channel(default_worker.address) as channel:
        stub = pb_grpc.WorkerStub(channel)
        assert not stub.ListModels(pb.ListModelsRequest()).models[0].accepts_images
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(chat("Look:", encoded(noise(9)))))
    details = read_details(info.value)
    assert details.code == grpc.StatusCode.INVALID_ARGUMENT and details.param == "messages[0].parts"


@pytest.mark.parametrize("arch", ["qwen3_5", "gemma4"])
def test_the_2026_multimodal_families_serve_images_over_their_own_pools(
    arch: str, tmp_path: Path, tiny_vlm: Callable[[str], Path]
) -> None:
    """The Qwen3.5 and Gemma 4 checkpoints as released (Qwen3_5ForConditionalGeneration: a vision
    tower beside the hybrid language model, Qwen3-VL's processor; Gemma4ForConditionalGeneration:
    its variable-resolution tower beside KV-sharing layers and per-layer embeddings, its "vision"
    bidirectional mode; each with its own template): ListModels advertises images; an image decodes
    greedily like transformers' ``generate`` with its logprobs; the same image again is served
    from the cache past the image (Qwen3.5: a state checkpoint) and decodes the same tokens."""
    from transformers import AutoModelForImageTextToText

    folder = tiny_vlm(arch)
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    image = noise(12)
    with (
        WorkerProcess(cache_dir=tmp_path, log_dir=tmp_path, model=str(folder), extra=WORKER_FLAGS) as worker,
        grpc.insecure_channel(worker.address) as channel,
    ):
        served = Served(arch, pb_grpc.WorkerStub(channel), tiny_processor(folder), model, "")
        assert served.stub.ListModels(pb.ListModelsRequest()).models[0].accepts_images
        first = list(served.stub.Generate(chat(encoded(image), "What is in this picture?")))
        again = list(served.stub.Generate(chat(encoded(image), "What is in this picture?")))
    prompt, expected, expected_logprobs = reference(served, image, "What is in this picture?")
    start, end = image_span(served, prompt)
    assert first[0].started.prompt_tokens == len(prompt)
    assert generated(first) == expected
    assert torch.allclose(logprobs(first), expected_logprobs, atol=5e-3, rtol=0)
    assert first[-1].usage.cached_tokens <= start
    assert again[-1].usage.cached_tokens >= end  # the image's tokens come from the cache
    assert generated(again) == expected


def edge_chat(served: Served, image_url: str, text: str) -> httpx.Response:
    body = {
        "model": served.stub.ListModels(pb.ListModelsRequest()).models[0].id,
        "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": image_url}}, {"type": "text", "text": text},
        ]}],
        "max_tokens": GREEDY_TOKENS, "temperature": 0, "ignore_eos": True, "logprobs": True,
    }  # fmt: skip
    return httpx.post(f"{served.edge_url}/v1/chat/completions", json=body, timeout=120)


def test_through_the_edge_an_image_url_decodes_like_transformers_and_is_cached_next_turn(
    served: Served,
) -> None:
    image = noise(11)
    prompt, expected, expected_logprobs = reference(served, image, "What is this?")
    start, end = image_span(served, prompt)
    first = edge_chat(served, data_url(encoded(image)), "What is this?")
    assert first.status_code == 200, first.text
    answer = first.json()
    assert answer["usage"]["prompt_tokens"] == len(prompt)
    assert answer["usage"]["completion_tokens"] == len(expected)
    served_logprobs = torch.tensor(
        [entry["logprob"] for entry in answer["choices"][0]["logprobs"]["content"]]
    )
    assert torch.allclose(served_logprobs, expected_logprobs, atol=2e-3, rtol=0)  # the same tokens
    again = edge_chat(served, data_url(encoded(image)), "What is this?").json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= end > start
    assert again["choices"][0]["message"]["content"] == answer["choices"][0]["message"]["content"]


def test_through_the_edge_a_loopback_image_url_is_refused(served: Served) -> None:
    reply = edge_chat(served, "http://127.0.0.1:9/cat.png", "What is this?")
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "messages[0].content[0]"
