"""The draft model of ``--speculative draft``: a second causal LM sharing the target's tokenizer
proposes a row's next tokens greedily, one forward each, keeping a KV cache per row that follows the
row's tokens (cut back where they diverged from what it guessed), on the model's device and dtype;
docs/worker.md."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from worker.model.loader import LoadedModel, ModelLoadError
from worker.model.recurrent import find_mixers


@dataclass
class DraftCache:
    """One row's draft KV cache and the tokens whose keys and values it holds."""

    cache: Any = field(default_factory=DynamicCache)
    tokens: list[int] = field(default_factory=list)


class DraftModel:
    """Greedy proposals of a loaded draft model (:meth:`propose`)."""

    def __init__(self, draft: LoadedModel, target: LoadedModel):
        """Raises :class:`ModelLoadError` naming ``--draft-model`` unless both tokenizers are the same,
        or for a hybrid draft (its recurrent states cannot be cut back where proposals diverged)."""
        draft_tokenizer, target_tokenizer = draft.tokenizer, target.tokenizer
        assert draft_tokenizer is not None and target_tokenizer is not None, "a follower rank's load"
        if draft_tokenizer.get_vocab() != target_tokenizer.get_vocab():
            raise ModelLoadError(
                f"the draft model {draft.model_id} does not share the model's tokenizer", param="draft_model"
            )
        if find_mixers(draft.model):
            kind = getattr(draft.model.config.get_text_config(), "model_type", "?")
            raise ModelLoadError(
                f"the draft model {draft.model_id} ({kind}) has recurrent layers, whose states cannot be "
                "cut back where its proposals diverge; use an attention-only draft",
                param="draft_model",
            )
        self.loaded = draft
        self.vocab = len(target_tokenizer)

    @property
    def context_length(self) -> int:
        return self.loaded.context_length

    def propose(self, row: DraftCache, tokens: Sequence[int], k: int) -> list[int]:
        """The draft's ``k`` greedy tokens after ``tokens`` (the row's prompt and output); ``row``'s
        cache keeps what it computed, and what of it no longer matches ``tokens`` is cut off first."""
        if k <= 0 or len(tokens) + k > self.context_length:
            return []
        common = 0
        limit = min(len(row.tokens), len(tokens) - 1)  # the last token is fed: its logits are needed
        while common < limit and row.tokens[common] == tokens[common]:
            common += 1
        if common < len(row.tokens):
            row.cache.crop(common - len(row.tokens))
            del row.tokens[common:]
        feed = list(tokens[common:])
        proposals: list[int] = []
        device = self.loaded.device
        with torch.inference_mode():
            for _ in range(k):
                ids = torch.tensor([feed], device=device)
                logits = self.loaded.model(ids, cache=row.cache, use_cache=True).logits[0, -1]
                row.tokens += feed
                best = int(logits[: self.vocab].argmax())
                proposals.append(best)
                feed = [best]
        return proposals
