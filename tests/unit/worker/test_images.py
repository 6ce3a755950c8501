"""Image parts without a model: parsing, decoding, cache keys, chunk ends and the bidirectional mask."""

from __future__ import annotations

import io

import pytest
import torch
from PIL import Image

from sluice.v1 import worker_pb2 as pb
from worker.attention.paged import Chunk, chunk_mask
from worker.engine.kv_blocks import BlockManager
from worker.engine.scheduler import SeqState
from worker.errors import InvalidRequest, WorkerError
from worker.prompts.images import ImageData, decode_image, image_key
from worker.prompts.prompt import PromptRenderer
from worker.service.convert import parse_request
from worker.types import PromptImage

MODEL = "m"


def encoded(image: Image.Image, fmt: str, **options) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **options)
    return out.getvalue()


def image_message(*parts: pb.ContentPart, content: str | None = None) -> pb.GenerateRequest:
    message = pb.ChatMessage(role="user", parts=list(parts))
    if content is not None:
        message.content = content
    return pb.GenerateRequest(model=MODEL, chat=pb.ChatInput(messages=[message]))


def test_parts_parse_in_order() -> None:
    data = encoded(Image.new("RGB", (4, 4)), "PNG")
    parsed = parse_request(
        image_message(
            pb.ContentPart(text="look"), pb.ContentPart(image=pb.ImageInput(data=data, mime_type="image/png"))
        ),
        MODEL,
    )
    message = parsed.prompt.messages[0]
    assert message.content is None and message.parts == ("look", ImageData(data, "image/png", ""))


@pytest.mark.parametrize(
    ("request_", "param"),
    [
        (image_message(pb.ContentPart(text="a"), content="b"), "messages[0].parts"),
        (image_message(pb.ContentPart(text="a"), pb.ContentPart()), "messages[0].parts[1]"),
    ],
)
def test_bad_parts_are_refused_naming_them(request_: pb.GenerateRequest, param: str) -> None:
    with pytest.raises(WorkerError) as info:
        parse_request(request_, MODEL)
    assert info.value.param == param


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_formats_decode_to_rgb(fmt: str) -> None:
    mode = "RGB" if fmt == "JPEG" else "RGBA"
    image = decode_image(ImageData(encoded(Image.new(mode, (5, 3)), fmt)), "p")
    assert image.mode == "RGB" and image.size == (5, 3)


def test_a_gif_gives_its_first_frame() -> None:
    frames = [Image.new("RGB", (4, 4), (255, 0, 0)), Image.new("RGB", (4, 4), (0, 0, 255))]
    data = encoded(frames[0], "GIF", save_all=True, append_images=frames[1:])
    assert decode_image(ImageData(data), "p").getpixel((0, 0)) == (255, 0, 0)


@pytest.mark.parametrize(
    ("image", "why"),
    [
        (ImageData(b"nope"), "cannot be decoded"),
        (ImageData(b""), "empty"),
        (ImageData(encoded(Image.new("RGB", (4, 4)), "BMP")), "unsupported image format BMP"),
        (ImageData(encoded(Image.new("RGB", (4, 4)), "PNG"), "image/tiff"), "unsupported image type"),
    ],
)
def test_bad_images_are_refused_naming_the_part(image: ImageData, why: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        decode_image(image, "messages[2].parts[1]")
    assert info.value.param == "messages[2].parts[1]" and why in str(info.value)


def test_a_text_only_renderer_refuses_images() -> None:
    class Tokenizer:
        chat_template = "{{ messages }}"

        def __len__(self) -> int:
            return 10

    renderer = PromptRenderer(Tokenizer())
    parsed = parse_request(image_message(pb.ContentPart(image=pb.ImageInput(data=b"x"))), MODEL)
    with pytest.raises(InvalidRequest) as info:
        renderer.render(parsed.prompt)
    assert info.value.param == "messages[0].parts"


def test_image_keys_follow_the_bytes() -> None:
    assert image_key(b"abc") == image_key(b"abc") < 0
    assert image_key(b"abc") != image_key(b"abd")


def sequence(images: tuple[PromptImage, ...], length: int = 20) -> SeqState:
    return SeqState(list(range(100, 100 + length)), length, length + 4, images=images)


def test_chunks_never_end_inside_an_image() -> None:
    seq = sequence((PromptImage(4, 12, -5, {}),))
    assert seq.chunk(3) == 3  # ends before the image
    assert seq.chunk(8) == 4  # ended inside it: back to its start
    assert seq.chunk(12) == 12
    seq.computed = 4
    assert seq.chunk(3) == 8  # starts at it: on to its end
    seq.computed = 6  # a cached prefix ended inside it
    assert seq.chunk(1) == 6


def test_cache_keys_replace_an_image_by_its_key() -> None:
    image = PromptImage(4, 8, -7, {})
    seq = sequence((image,), 12)
    assert list(seq.cache_keys[0:12]) == [100, 101, 102, 103, -7, -7, -7, -7, 108, 109, 110, 111]
    blocks = BlockManager(8, 4)
    blocks.commit(seq.blocks, seq.cache_keys, 0)
    assert blocks.ensure(seq.blocks, 12)
    blocks.commit(seq.blocks, seq.cache_keys, 12)
    same = sequence((PromptImage(4, 8, -7, {}),), 12)
    other = sequence((PromptImage(4, 8, -8, {}),), 12)
    assert blocks.cached_length(same.cache_keys) == 8
    assert blocks.cached_length(other.cache_keys) == 4


def test_an_image_block_sees_its_later_tokens_within_the_window() -> None:
    mask = chunk_mask(6, 6, 1, torch.device("cpu"), None, ((1, 4),))
    assert mask is not None
    assert mask[1, 3] and mask[2, 3] and not mask[0, 1] and not mask[4, 5]
    windowed = chunk_mask(6, 6, 1, torch.device("cpu"), 2, ((1, 4),))
    assert windowed is not None
    assert windowed[1, 3] and not windowed[3, 1]  # key 1 is outside query 3's window of 2
    assert torch.equal(chunk_mask(6, 6, 2, torch.device("cpu"), None, ((1, 4),))[6:], mask)


def test_windowed_spans_are_bidirectional_on_sliding_layers_only() -> None:
    """Gemma 4's "vision" mode: a global layer (no window) keeps its causal mask."""
    chunk = Chunk(0, 6, 6, torch.zeros(2, dtype=torch.long), spans=((1, 4),), windowed_spans=True)
    assert chunk.mask(None, 1) is None  # a whole prompt, causal: SDPA's own mask
    sliding = chunk.mask(8, 1)
    assert sliding is not None and sliding[1, 3] and not sliding[0, 1]


def test_an_unserved_vision_language_architecture_is_refused_naming_it() -> None:
    import transformers

    from worker.model.loader import ModelLoadError
    from worker.model.vision import vision_spec

    assert vision_spec(transformers.LlamaConfig()) is None
    with pytest.raises(ModelLoadError) as info:
        vision_spec(transformers.LlavaNextConfig())
    assert "llava_next" in str(info.value) and "served: gemma3, gemma4, idefics3, llava" in str(info.value)


def test_mrope_positions_equal_transformers_rope_index() -> None:
    """Two images (a wide and a tall grid) between text, against Qwen2-VL's own get_rope_index."""
    import transformers

    from worker.model.step_inputs import mrope_delta
    from worker.model.vision import mrope_positions

    config = transformers.Qwen2VLConfig(
        text_config={"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 64},
        vision_config={
            "depth": 1,
            "embed_dim": 16,
            "hidden_size": 16,
            "num_heads": 2,
            "spatial_merge_size": 2,
        },
        image_token_id=9,
    )
    model = transformers.Qwen2VLModel(config)
    grids = [(1, 4, 6), (1, 6, 2)]  # patches; tokens are these over the 2x2 merge
    text = [[1, 2, 3], [4, 5], [6, 7, 8, 1]]
    ids: list[int] = []
    starts = []
    for index, part in enumerate(text):
        ids += part
        if index < len(grids):
            starts.append(len(ids))
            ids += [9] * (grids[index][1] * grids[index][2] // 4)
    types = torch.tensor([[int(t == 9) for t in ids]])
    expected, delta = model.get_rope_index(torch.tensor([ids]), types, image_grid_thw=torch.tensor(grids))
    merged = tuple((start, (t, h // 2, w // 2)) for start, (t, h, w) in zip(starts, grids, strict=True))
    assert torch.equal(mrope_positions(merged, 0, len(ids)), expected[:, 0])
    assert torch.equal(mrope_positions(merged, 5, 9), expected[:, 0, 5:14])  # a chunk's slice alone
    assert mrope_delta(merged, len(ids)) == int(delta)
    # A one-token chunk runs as a decode row at its 1-D position plus the delta: before, between
    # and after the images, moved by the images before it alone.
    for position in (p for p, token in enumerate(ids) if token != 9):
        assert position + mrope_delta(merged, position) == int(expected[0, 0, position]), position
