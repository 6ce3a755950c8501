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

from worker.model.loader import ModelLoadError, is_vision_config
from worker.model.step_inputs import ChunkImage

log = logging.getLogger(__name__)

# model_type -> whether an image's placeholder tokens attend to each other both ways in prefill
# (Gemma 3: the image's tokens are one bidirectional block, as transformers' mask has them).
SERVED: dict[str, bool] = {
    "llava": False,
    "gemma3": True,
    "idefics3": False,
    "qwen2_vl": False,
    "qwen2_5_vl": False,
    "qwen3_5": False,
    "qwen3_5_moe": False,
    "gemma4": False,  # with use_bidirectional_attention "vision": on its sliding layers (vision_spec)
}
# Architectures whose rotary positions are 3-D (M-RoPE): an image's tokens take (time, row, column).
# Qwen3.5's interleaved sections read the same positions (its rotary embedding interleaves them).
MROPE = frozenset({"qwen2_vl", "qwen2_5_vl", "qwen3_5", "qwen3_5_moe"})


@dataclass(frozen=True)
class VisionSpec:
    """What the engine needs to know of a vision-language model: its placeholder token, and
    whether an image's placeholder run attends bidirectionally (so a prefill chunk never splits it)."""

    model_type: str
    image_token_id: int
    bidirectional: bool
    # M-RoPE: how many patches per side the vision tower merges into one token (None: 1-D positions).
    mrope_merge: int | None = None
    # The bidirectional runs only on sliding-window layers (Gemma 4's "vision" mode; global: causal).
    windowed_only: bool = False


def vision_spec(config: Any) -> VisionSpec | None:
    """The spec of a served vision-language config, None for a text-only one; raises
    :class:`ModelLoadError` for another vision-language architecture."""
    if not is_vision_config(config):
        return None
    kind = str(getattr(config, "model_type", "?"))
    names = ", ".join(getattr(config, "architectures", None) or []) or kind
    if kind not in SERVED:
        raise ModelLoadError(
            f"{names} ({kind}) is a vision-language architecture Sluice does not serve yet; "
            f"served: {', '.join(sorted(SERVED))} (docs/models.md)"
        )
    token = getattr(config, "image_token_id", None)
    if token is None:
        token = getattr(config, "image_token_index", None)
    if token is None:
        raise ModelLoadError(f"{names} ({kind}): the config names no image token (image_token_id)")
    merge = int(config.vision_config.spatial_merge_size) if kind in MROPE else None
    if kind == "gemma4":  # images bidirectional on the sliding layers in its "vision" mode alone
        vision_mode = getattr(config.get_text_config(), "use_bidirectional_attention", None) == "vision"
        return VisionSpec(kind, int(token), vision_mode, None, windowed_only=vision_mode)
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
        text = config.get_text_config()
        # Gemma 4's per-layer embeddings: its placeholders read the padding token's, as in
        # transformers' own forward (the language model's lookup, computed beside the features).
        self._per_layer: Any = None
        if getattr(text, "hidden_size_per_layer_input", None):
            self._per_layer = model.model.language_model.get_per_layer_inputs
            self._pad_token_id = int(text.pad_token_id)
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

    def inputs(
        self, ids: torch.Tensor, images: Sequence[ChunkImage], spans: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """The language model's inputs for ``ids`` ``[1, T]`` with the step's images: the input
        embeddings (:meth:`embed`), and for a model with per-layer embeddings (Gemma 4) those
        inputs, each placeholder's the padding token's."""
        embeds = self.embed(ids, images, spans)
        if self._per_layer is None:
            return {"inputs_embeds": embeds}
        placeholders = (ids == self.spec.image_token_id) & spans.to(ids.device)
        text_ids = ids.masked_fill(placeholders, self._pad_token_id)
        return {"inputs_embeds": embeds, "per_layer_inputs": self._per_layer(text_ids, None)}

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
