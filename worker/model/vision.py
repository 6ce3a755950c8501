"""Vision-language models: which architectures are served, their vision encoder batched over a
step's images, and the image features merged into the input embeddings at the placeholders.

Design notes: docs/worker.md (Images); the architectures: docs/models.md.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from worker.model.loader import ModelLoadError
from worker.model.step_inputs import ChunkImage
from worker.model.text_only import TEXT_ONLY, images_not_served, is_vision_config

log = logging.getLogger(__name__)

# model_type -> whether an image's placeholder tokens attend to each other both ways in prefill
# (Gemma 3: the image's tokens are one bidirectional block, as transformers' mask has them).
SERVED: dict[str, bool] = {
    "llava": False,
    "gemma3": True,
    "idefics3": False,
    "qwen2_vl": False,
    "qwen2_5_vl": False,
}
# Architectures whose rotary positions are 3-D (M-RoPE): an image's tokens take (time, row, column).
MROPE = frozenset({"qwen2_vl", "qwen2_5_vl"})


@dataclass(frozen=True)
class VisionSpec:
    """What the engine needs to know of a vision-language model: its placeholder token, and
    whether an image's placeholder run attends bidirectionally (so a prefill chunk never splits it)."""

    model_type: str
    image_token_id: int
    bidirectional: bool
    # M-RoPE: how many patches per side the vision tower merges into one token (None: 1-D positions).
    mrope_merge: int | None = None


def vision_spec(config: Any) -> VisionSpec | None:
    """The spec of a served vision-language config, None for a text-only one or one served for text
    alone (:data:`TEXT_ONLY`); raises :class:`ModelLoadError` for another vision-language architecture."""
    if not is_vision_config(config) or images_not_served(config) is not None:
        return None
    kind = str(getattr(config, "model_type", "?"))
    names = ", ".join(getattr(config, "architectures", None) or []) or kind
    if kind not in SERVED:
        raise ModelLoadError(
            f"{names} ({kind}) is a vision-language architecture Sluice does not serve yet; "
            f"served: {', '.join(sorted(SERVED))}, and for text alone {', '.join(sorted(TEXT_ONLY))} "
            "(docs/models.md)"
        )
    token = getattr(config, "image_token_id", None)
    if token is None:
        token = getattr(config, "image_token_index", None)
    if token is None:
        raise ModelLoadError(f"{names} ({kind}): the config names no image token (image_token_id)")
    merge = int(config.vision_config.spatial_merge_size) if kind in MROPE else None
    return VisionSpec(kind, int(token), SERVED[kind], merge)


class VisionEncoder:
    """Runs one model's vision tower and merges its features; on the model thread only."""

    def __init__(self, model: Any, spec: VisionSpec, device: torch.device, dtype: torch.dtype):
        self.model = model
        self.spec = spec
        self.device = device
        self.dtype = dtype
        self.embed_tokens = model.get_input_embeddings()
        config = model.config
        # LLaVA's encoder call names the layer and the CLS handling its config chose.
        self._options = {
            name: getattr(config, name)
            for name in ("vision_feature_layer", "vision_feature_select_strategy")
            if getattr(config, name, None) is not None
        }

    def features(self, images: Sequence[Any]) -> list[torch.Tensor]:
        """Each image's features ``[placeholders, hidden]``, from one encoder call per equal-shape
        batch (the step's images stacked)."""
        out: list[torch.Tensor | None] = [None] * len(images)
        groups: dict[tuple[Any, ...], list[int]] = {}
        for index, inputs in enumerate(images):
            key = tuple(sorted((name, np.shape(value)) for name, value in inputs.items()))
            groups.setdefault(key, []).append(index)
        for indexes in groups.values():
            batch = {
                name: torch.from_numpy(np.concatenate([images[i][name] for i in indexes])).to(self.device)
                for name in images[indexes[0]]
            }
            pixels = batch.pop("pixel_values").to(self.dtype)
            encoded = self.model.get_image_features(
                pixel_values=pixels, return_dict=True, **self._options, **batch
            )
            features = encoded.pooler_output  # [images, tokens, hidden], or one tensor per image
            for row, index in enumerate(indexes):
                out[index] = features[row].reshape(-1, features[row].shape[-1])
        return [feature for feature in out if feature is not None]

    def embed(self, ids: torch.Tensor, images: Sequence[ChunkImage], spans: torch.Tensor) -> torch.Tensor:
        """The input embeddings of ``ids`` ``[1, T]`` with the images' feature rows at their
        placeholders, in order (the chunks' images as the flat sequence holds them): the tokens
        that are the image token within ``spans`` (bool ``[T]``: the flat tokens inside an image's
        span), so a generated or proposed token that happens to be the image token is left alone."""
        encoded = self.features([image.inputs for image in images])
        rows = torch.cat(
            [
                feature[image.first : image.first + image.rows]
                for feature, image in zip(encoded, images, strict=True)
            ]
        )
        embeds = self.embed_tokens(ids)
        mask = ((ids == self.spec.image_token_id) & spans.to(ids.device)).unsqueeze(-1)
        if int(mask.sum()) != rows.shape[0]:
            raise RuntimeError(
                f"{int(mask.sum())} image placeholders in the step, {rows.shape[0]} feature rows"
            )
        return embeds.masked_scatter(mask.expand_as(embeds), rows.to(embeds.dtype))


def mrope_positions(
    grids: Sequence[tuple[int, tuple[int, int, int]]], start: int, count: int
) -> torch.Tensor:
    """M-RoPE positions ``[3, count]`` of a sequence's tokens ``start..`` whose images begin at the
    given positions with these token grids (time, rows, columns), as Qwen2-VL's ``get_rope_index``
    lays them out: an image's tokens take ``(base + t, base + row, base + column)``, and the text
    after it goes on from ``base + max(rows, columns)`` instead of after its token count."""
    positions = torch.arange(start, start + count)
    out = positions.expand(3, count).clone()
    shift = 0  # what the images before the current one moved the positions by
    for image_start, (frames, rows, columns) in grids:
        tokens = frames * rows * columns
        end = image_start + tokens
        inside = (positions >= image_start) & (positions < end)
        if bool(inside.any()):
            offset = positions[inside] - image_start
            base = image_start + shift
            out[0, inside] = base + offset // (rows * columns)
            out[1, inside] = base + (offset // columns) % rows
            out[2, inside] = base + offset % columns
        moved = max(rows, columns) - tokens
        out[:, positions >= end] += moved
        shift += moved
    return out
