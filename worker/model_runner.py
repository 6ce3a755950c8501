"""Executes the model: the only module that runs torch forward passes.

Each sequence owns a transformers ``DynamicCache``. ``prefill`` runs a whole
prompt and returns the logits of its last position; ``decode`` advances a set
of sequences by one token each and returns one row of logits per sequence.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
from transformers import DynamicCache

from worker.model_loader import LoadedModel


class ModelRunner:
    def __init__(self, loaded: LoadedModel):
        self.model = loaded.model
        self.device = loaded.device
        self.config = loaded.model.config

    @torch.inference_mode()
    def prefill(self, prompt_token_ids: Sequence[int]) -> tuple[torch.Tensor, Any]:
        """Runs the prompt; returns (logits of the last position [vocab], its cache)."""
        cache = DynamicCache(config=self.config)
        ids = torch.tensor([list(prompt_token_ids)], dtype=torch.long, device=self.device)
        out = self.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1].float().cpu(), out.past_key_values

    @torch.inference_mode()
    def decode(self, batch: Sequence[tuple[int, Any]]) -> torch.Tensor:
        """Advances each (last token, cache) by one token; returns logits [len(batch), vocab]."""
        rows = []
        for token_id, cache in batch:
            ids = torch.tensor([[token_id]], dtype=torch.long, device=self.device)
            out = self.model(input_ids=ids, past_key_values=cache, use_cache=True)
            rows.append(out.logits[0, -1])
        return torch.stack(rows).float().cpu()

    @staticmethod
    def fork(cache: Any) -> Any:
        """A private copy of a prefilled cache (for the other choices of an n > 1 request)."""
        return copy.deepcopy(cache)
