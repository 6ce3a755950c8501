"""Images in a chat prompt: bytes decoded with PIL (a GIF's first frame), then the model's own
processor's pixel arrays and placeholder tokens; runs in the prepare threads.

Design notes: docs/worker.md (Images).
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image, UnidentifiedImageError

from worker.errors import InvalidRequest
from worker.model.vision import VisionSpec
from worker.types import PromptImage

FORMATS = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp", "GIF": "image/gif"}
# Processor outputs that describe the text, not one image.
TEXT_KEYS = frozenset({"input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids"})


@dataclass(frozen=True)
class ImageData:
    """An image part as it came: the encoded file, its declared type (may be empty), ``detail``."""

    data: bytes
    mime_type: str = ""
    detail: str = ""


def decode_image(image: ImageData, param: str) -> Image.Image:
    """The image as RGB pixels; InvalidRequest naming ``param`` for bytes PIL cannot read or a
    format other than PNG, JPEG, WebP and GIF (its first frame)."""
    declared = image.mime_type.lower()
    if declared and declared not in FORMATS.values():
        raise InvalidRequest(
            f"{param}: unsupported image type {image.mime_type!r}; send PNG, JPEG, WebP or GIF", param=param
        )
    if not image.data:
        raise InvalidRequest(f"{param}: the image is empty", param=param)
    try:
        with Image.open(io.BytesIO(image.data)) as opened:
            if opened.format not in FORMATS:
                raise InvalidRequest(
                    f"{param}: unsupported image format {opened.format}; send PNG, JPEG, WebP or GIF",
                    param=param,
                )
            opened.seek(0)  # a GIF's (or animated WebP's) first frame
            return opened.convert("RGB")
    except InvalidRequest:
        raise
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise InvalidRequest(f"{param}: the image cannot be decoded ({exc})", param=param) from exc


def image_key(data: bytes) -> int:
    """The prefix cache's key for an image's placeholder tokens: a negative number from a hash of
    its bytes (never a token id), so equal images share cached blocks and others never do."""
    return -1 - int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class ImageProcessing:
    """One vision-language model's processor, placeholder token and (M-RoPE models) merge size."""

    def __init__(self, processor: Any, spec: VisionSpec):
        self._processor = processor
        self.image_token_id = spec.image_token_id
        self._merge = spec.mrope_merge
        # Idefics3: an image is several tiles, each a run of placeholders after its own marker; the
        # run after this marker (the whole image, downscaled) is the image's last.
        self._last_tile_marker: int | None = getattr(processor, "global_image_token_id", None)

    def process(
        self, text: str, images: Sequence[tuple[ImageData, str]]
    ) -> tuple[tuple[int, ...], tuple[PromptImage, ...]]:
        """The prompt ``text`` (the chat template's, with one image marker per image) tokenized by
        the processor with its placeholders expanded, and each image's span, key and arrays."""
        pixels = [decode_image(image, param) for image, param in images]
        try:
            out = self._processor(text=[text], images=pixels, add_special_tokens=False, return_tensors="np")
        except (ValueError, TypeError) as exc:
            raise InvalidRequest(
                f"the model's processor rejected the images: {exc}", param="messages"
            ) from exc
        ids = tuple(int(token) for token in np.asarray(out["input_ids"])[0])
        groups = self._images_runs(ids)
        spans = [(runs[0][0], runs[-1][1]) for runs in groups]
        if len(spans) != len(images):
            raise InvalidRequest(
                f"the prompt holds {len(spans)} image placeholders for {len(images)} images; "
                "the chat template must render each image part once",
                param="messages",
            )
        arrays = {name: np.asarray(value) for name, value in out.items() if name not in TEXT_KEYS}
        inputs, grids = self._per_image(arrays, [len(runs) for runs in groups])
        prompt_images = tuple(
            PromptImage(
                start,
                end,
                image_key(image.data),
                inputs[index],
                grids[index],
                tuple(groups[index]) if len(groups[index]) > 1 else (),
            )
            for index, ((start, end), (image, _)) in enumerate(zip(spans, images, strict=True))
        )
        for prompt_image in prompt_images:
            if prompt_image.grid and int(np.prod(prompt_image.grid)) != prompt_image.end - prompt_image.start:
                raise RuntimeError("the processor's image grid does not match its placeholders")
        return ids, prompt_images

    def _images_runs(self, ids: Sequence[int]) -> list[list[tuple[int, int]]]:
        """The placeholder runs of each image, in order: one run per image, or (Idefics3) the runs
        up to and including the one after the last-tile marker."""
        runs = _runs(ids, self.image_token_id)
        if self._last_tile_marker is None:
            return [[run] for run in runs]
        groups: list[list[tuple[int, int]]] = [[]]
        for run in runs:
            groups[-1].append(run)
            if run[0] > 0 and ids[run[0] - 1] == self._last_tile_marker:
                groups.append([])
        return [group for group in groups if group]

    def _per_image(
        self, arrays: dict[str, np.ndarray], tiles: list[int]
    ) -> tuple[list[dict[str, np.ndarray]], list[tuple[int, ...]]]:
        """Each image's own arrays (and token grid, for M-RoPE): by the first dimension; for tiled
        images (Idefics3, ``[1, tiles, ...]``) by each image's tiles; for a processor that flattens
        every image's patches into one list (Qwen2-VL) by each image's patch count (``image_grid_thw``)."""
        count = len(tiles)
        none: list[tuple[int, ...]] = [()] * count
        if "image_grid_thw" not in arrays:
            if "pixel_values" in arrays and arrays["pixel_values"].ndim == 5:
                bounds = np.concatenate([[0], np.cumsum(tiles)])
                return [
                    {name: value[:, bounds[i] : bounds[i + 1]] for name, value in arrays.items()}
                    for i in range(count)
                ], none
            return [{name: value[i : i + 1] for name, value in arrays.items()} for i in range(count)], none
        grid = arrays["image_grid_thw"]
        bounds = np.concatenate([[0], np.cumsum(np.prod(grid, axis=1))])
        merge = self._merge or 1
        inputs = [
            {
                name: value[bounds[i] : bounds[i + 1]] if name == "pixel_values" else value[i : i + 1]
                for name, value in arrays.items()
            }
            for i in range(count)
        ]
        grids = [(int(t), int(h) // merge, int(w) // merge) for t, h, w in grid]
        return inputs, list(grids)


def _runs(ids: Sequence[int], token: int) -> list[tuple[int, int]]:
    """The ``[start, end)`` of each run of ``token`` in ``ids``."""
    runs: list[tuple[int, int]] = []
    start = None
    for position, value in enumerate((*ids, None)):
        if value == token and start is None:
            start = position
        elif value != token and start is not None:
            runs.append((start, position))
            start = None
    return runs
