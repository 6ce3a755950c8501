"""Fill-in-the-middle: a model's FIM tokens, found in its vocabulary at load, and a prompt laid out
with them (the text before the gap, the text after it, then the model writes the middle)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from worker.prompts.vocabulary import TokenLookup


@dataclass(frozen=True)
class FimTokens:
    """The ids of one family's FIM markers. ``middle`` is None for a layout without a middle
    marker; ``suffix_first``: the suffix comes before the prefix (Codestral's layout)."""

    family: str
    prefix: int
    suffix: int
    middle: int | None = None
    suffix_first: bool = False

    def layout(self, prefix_ids: Sequence[int], suffix_ids: Sequence[int]) -> list[int]:
        """The FIM prompt's ids (without the tokenizer's BOS, which the caller adds)."""
        before = [self.prefix, *prefix_ids]
        after = [self.suffix, *suffix_ids]
        ids = [*after, *before] if self.suffix_first else [*before, *after]
        return ids if self.middle is None else [*ids, self.middle]


# family -> (prefix, suffix, middle or None, suffix first), by the markers' spelling in the vocabulary.
FIM_MARKERS: dict[str, tuple[str, str, str | None, bool]] = {
    "qwen": ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", False),  # Qwen2.5-Coder, Qwen3
    "starcoder": ("<fim_prefix>", "<fim_suffix>", "<fim_middle>", False),  # StarCoder, SantaCoder
    # DeepSeek-Coder, DeepSeek-V3 (full-width bars U+FF5C, U+2581 for the space)
    "deepseek": (
        "<\uff5cfim\u2581begin\uff5c>",
        "<\uff5cfim\u2581hole\uff5c>",
        "<\uff5cfim\u2581end\uff5c>",
        False,
    ),
    "codellama": ("▁<PRE>", "▁<SUF>", "▁<MID>", False),
    "codellama_gguf": ("<PRE>", "<SUF>", "<MID>", False),
    "codestral": ("[PREFIX]", "[SUFFIX]", None, True),  # Codestral: [SUFFIX]suffix[PREFIX]prefix
}


def find_fim_tokens(vocab: TokenLookup) -> FimTokens | None:
    """The first family in :data:`FIM_MARKERS` whose markers are all in ``vocab``; None if none is."""
    for family, (prefix, suffix, middle, suffix_first) in FIM_MARKERS.items():
        markers = (prefix, suffix) if middle is None else (prefix, suffix, middle)
        if all(marker in vocab for marker in markers):
            return FimTokens(
                family,
                vocab[prefix],
                vocab[suffix],
                vocab[middle] if middle is not None else None,
                suffix_first,
            )
    return None
