"""The vocabulary split over the tensor-parallel ranks: each rank holds a slice of the embedding's
rows and of the output layer's (one tensor where they are tied); an embedding's rows and the logits
are summed over the ranks, so every rank gets the full logits once, from the head inside the forward.

Design notes: docs/worker.md, "Tensor parallelism"."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

AllReduce = Callable[[torch.Tensor], None]


def vocabulary_slice(vocabulary: int, rank: int, ranks: int) -> tuple[int, int]:
    """Rank ``rank``'s rows: ``(first, count)``, ``ceil(vocabulary / ranks)`` each, the last ones
    fewer where the vocabulary does not divide by ``ranks``."""
    per_rank = -(-vocabulary // ranks)
    first = min(rank * per_rank, vocabulary)
    return first, min(per_rank, vocabulary - first)


class VocabParallelEmbedding(nn.Module):
    """An embedding of this rank's rows: ids outside them give zeros, and the ranks' sum gives each
    token its row (times a scaled embedding's ``embed_scale``, as Gemma's)."""

    def __init__(self, embedding: nn.Embedding, first: int, count: int, all_reduce: AllReduce):
        super().__init__()
        self.weight = nn.Parameter(embedding.weight.data[first : first + count].clone(), requires_grad=False)
        self.first, self.count = first, count
        self.num_embeddings, self.embedding_dim = (
            int(embedding.weight.shape[0]),
            int(embedding.weight.shape[1]),
        )
        scale = getattr(embedding, "embed_scale", None)
        self.embed_scale = scale if isinstance(scale, torch.Tensor) else None
        self._all_reduce = all_reduce

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.count:  # a vocabulary smaller than the ranks' slices: this rank holds none
            rows = torch.zeros(*ids.shape, self.embedding_dim, dtype=self.weight.dtype, device=ids.device)
            self._all_reduce(rows)
            return rows if self.embed_scale is None else rows * self.embed_scale.to(rows.dtype)
        local = ids - self.first
        mine = (local >= 0) & (local < self.count)
        rows = F.embedding(local.clamp(0, self.count - 1), self.weight)
        rows = rows * mine.unsqueeze(-1).to(rows.dtype)
        if self.embed_scale is not None:
            rows = rows * self.embed_scale.to(rows.dtype)
        self._all_reduce(rows)
        return rows


class VocabParallelHead(nn.Module):
    """An output layer of this rank's rows (``part``): its logits written into a zero row of the
    whole vocabulary, and the ranks' sum gives every rank the full logits."""

    def __init__(self, part: nn.Linear, first: int, vocabulary: int, all_reduce: AllReduce):
        super().__init__()
        self.part = part
        self.first, self.vocabulary = first, vocabulary
        self._all_reduce = all_reduce

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = self.part(hidden)
        logits = local.new_zeros(*local.shape[:-1], self.vocabulary)
        logits[..., self.first : self.first + local.shape[-1]] = local
        self._all_reduce(logits)
        return logits


def shard_vocabulary(model: Any, rank: int, ranks: int, all_reduce: AllReduce) -> None:
    """Replaces the model's embedding (an ``nn.Embedding``, Gemma's scaled one too) and output layer
    by this rank's slices (one tensor for both where they are tied)."""
    embedding = model.get_input_embeddings()
    head = model.get_output_embeddings()
    if not isinstance(embedding, nn.Embedding):
        return  # a table of another kind (a model's own): it and the output layer stay whole
    vocabulary = int(embedding.weight.shape[0])
    first, count = vocabulary_slice(vocabulary, rank, ranks)
    tied = isinstance(head, nn.Linear) and head.weight is embedding.weight
    sliced = VocabParallelEmbedding(embedding, first, count, all_reduce)
    model.set_input_embeddings(sliced)
    if not isinstance(head, nn.Linear) or int(head.out_features) != vocabulary:
        return  # no output layer of the embedding's vocabulary: whatever it is stays whole
    part = nn.Linear(head.in_features, count, bias=head.bias is not None)
    part.to(device=head.weight.device, dtype=head.weight.dtype)
    part.weight = sliced.weight if tied else nn.Parameter(head.weight.data[first : first + count].clone())
    if part.bias is not None and head.bias is not None:
        part.bias.data = head.bias.data[first : first + count].clone()
    part.requires_grad_(False)
    model.set_output_embeddings(VocabParallelHead(part, first, vocabulary, all_reduce))
