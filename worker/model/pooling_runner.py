"""Executing a pooling model: a batch of inputs → one padded forward with an attention mask (no KV
cache) → one pooled vector per input (embed), or one score per input (score).

Design notes: docs/worker.md, "Embeddings and scores".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from worker.model.pooling import PoolingSpec, pool


@dataclass(frozen=True)
class PoolingInput:
    """One input as the model reads it: token ids and, for a text pair, the segment of each."""

    token_ids: tuple[int, ...]
    token_type_ids: tuple[int, ...] | None = None


class PoolingRunner:
    """The model's forward over a padded batch (right padding); ``forward`` returns float32 rows on
    the CPU: pooled hidden states (embed, not normalised) or one sigmoid score per row (score)."""

    def __init__(self, model: Any, spec: PoolingSpec, device: torch.device, pad_token_id: int) -> None:
        self.model = model
        self.spec = spec
        self.device = device
        self.pad_token_id = pad_token_id

    def forward(self, inputs: list[PoolingInput]) -> torch.Tensor:
        width = max(len(item.token_ids) for item in inputs)
        ids = torch.full((len(inputs), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(inputs), width), dtype=torch.long)
        segments = None
        if any(item.token_type_ids is not None for item in inputs):
            segments = torch.zeros((len(inputs), width), dtype=torch.long)
        for row, item in enumerate(inputs):
            count = len(item.token_ids)
            ids[row, :count] = torch.tensor(item.token_ids, dtype=torch.long)
            mask[row, :count] = 1
            if segments is not None and item.token_type_ids is not None:
                segments[row, :count] = torch.tensor(item.token_type_ids, dtype=torch.long)
        arguments: dict[str, torch.Tensor] = {
            "input_ids": ids.to(self.device),
            "attention_mask": mask.to(self.device),
        }
        if segments is not None:
            arguments["token_type_ids"] = segments.to(self.device)
        with torch.inference_mode():
            output = self.model(**arguments)
            if self.spec.task == "score":
                return torch.sigmoid(output.logits.float()[:, :1]).cpu()
            pooled = pool(output.last_hidden_state, arguments["attention_mask"], self.spec.mode)
            return pooled.float().cpu()
