"""Vision-language checkpoints served for text alone: their language model runs as the text-only
family's does, their vision (and audio) towers are loaded and never run, and their requests' image
parts are refused saying the images are not served yet.

Design notes: docs/worker.md (Images); the architectures: docs/models.md (Vision-language models).
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

# model_type -> why its images are not served yet: the checkpoint is served for text (its language
# model over the pools; its vision and audio towers loaded, never run) and image parts are refused.
TEXT_ONLY: dict[str, str] = {
    "gemma4": (
        "its image and audio features are not merged into the paged runner yet: variable-resolution "
        "patches, per-layer embeddings of the placeholders"
    ),
    "qwen3_5": "its vision tower and M-RoPE image positions are not wired into the runner yet",
    "qwen3_5_moe": "its vision tower and M-RoPE image positions are not wired into the runner yet",
}


def is_vision_config(config: Any) -> bool:
    return getattr(config, "vision_config", None) is not None


def images_not_served(config: Any) -> str | None:
    """Why a vision-language checkpoint served for text alone (:data:`TEXT_ONLY`) takes no images:
    the refusal of its requests' image parts; None for any other config."""
    kind = str(getattr(config, "model_type", "?"))
    if not is_vision_config(config) or kind not in TEXT_ONLY:
        return None
    return f"this model's images are not served yet ({kind}: {TEXT_ONLY[kind]}); send text only"


def serves_images(config: Any) -> bool:
    """The config is a vision-language model whose images are served (its processor is loaded)."""
    return is_vision_config(config) and images_not_served(config) is None


def log_text_only(config: Any) -> None:
    """The one line at load of a vision-language checkpoint served for text alone."""
    reason = images_not_served(config)
    if reason is not None:
        towers = " and ".join(
            name for name in ("vision", "audio") if getattr(config, f"{name}_config", None) is not None
        )
        log.info(
            "%s: served for text only; the %s %s loaded but not used, image parts are refused (%s)",
            getattr(config, "model_type", "?"),
            towers,
            "towers are" if " and " in towers else "tower is",
            TEXT_ONLY[str(config.model_type)],
        )
