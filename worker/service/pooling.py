"""``Embed`` and ``Score``: requests checked and tokenized (``EmbedRequest``/``ScoreRequest`` → the
pooling engine's inputs), and the engine's rows turned into vectors and scores.

Design notes: docs/worker.md, "Embeddings and scores".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from sluice.limits import MAX_POOLED_INPUTS
from sluice.v1 import worker_pb2 as pb
from worker.errors import InvalidRequest, ModelNotFound, WrongTask
from worker.model.loader import LoadedModel
from worker.model.pooling import finish_vectors
from worker.model.pooling_runner import PoolingInput


@dataclass(frozen=True)
class PoolingWork:
    """A checked request: the engine's inputs and how to turn its rows into the answer."""

    inputs: list[PoolingInput]
    dimensions: int = 0  # embed: 0 = the model's size
    pairs: int = 0  # score with an embedder: the rows are [text_1 ..., text_2 ...] of this many pairs

    @property
    def prompt_tokens(self) -> int:
        return sum(len(item.token_ids) for item in self.inputs)


def check_task(loaded: LoadedModel, call: str, model: str) -> None:
    """Raises :class:`WrongTask` when this worker's task does not serve ``call``, and
    :class:`ModelNotFound` for another model's name."""
    if model and model != loaded.model_id:
        raise ModelNotFound(f"model {model!r} is not served here; this worker serves {loaded.model_id!r}")
    serves = {"Generate": ("generate",), "Embed": ("embed",), "Score": ("embed", "score")}[call]
    if loaded.task not in serves:
        raise WrongTask(
            f"this worker serves {loaded.model_id!r} with task {loaded.task!r}; {call} needs a worker "
            f"started with --task {' or '.join(serves)}",
            param="model",
        )


def prepare_embed(loaded: LoadedModel, request: pb.EmbedRequest) -> PoolingWork:
    """Checks and tokenizes an ``EmbedRequest`` (blocking: run it off the event loop)."""
    spec = loaded.pooling
    assert spec is not None  # an embed worker has its pooling
    size = int(loaded.model.config.hidden_size)
    dimensions = request.dimensions
    if dimensions and dimensions != size and dimensions not in spec.matryoshka_dimensions:
        allowed = ", ".join(str(d) for d in (*spec.matryoshka_dimensions, size))
        raise InvalidRequest(
            f"dimensions {dimensions} is not served by {loaded.model_id!r}: it gives {allowed}"
            + ("" if spec.matryoshka_dimensions else " (it declares no Matryoshka dimensions)"),
            param="dimensions",
        )
    _check_count(len(request.inputs), "inputs")
    inputs = []
    for index, item in enumerate(request.inputs):
        where = f"inputs[{index}]"
        kind = item.WhichOneof("input")
        if kind == "text":
            ids = _encode(loaded.text_tokenizer, item.text, where)
        elif kind == "token_ids":
            ids = list(item.token_ids.ids)
            vocab = len(loaded.text_tokenizer)
            if not ids or any(not 0 <= token < vocab for token in ids):
                raise InvalidRequest(f"{where}: token ids must be non-empty and in [0, {vocab})", param=where)
        else:
            raise InvalidRequest(f"{where}: give text or token_ids", param=where)
        _check_length(len(ids), loaded.context_length, where)
        inputs.append(PoolingInput(tuple(ids)))
    return PoolingWork(inputs, dimensions if dimensions != size else 0)


def prepare_score(loaded: LoadedModel, request: pb.ScoreRequest) -> PoolingWork:
    """Checks and tokenizes a ``ScoreRequest``: for a cross-encoder each pair is one input (the
    tokenizer's pair encoding), for an embedder each text is one (each pair's cosine follows)."""
    _check_count(len(request.pairs), "pairs")
    tokenizer, limit = loaded.text_tokenizer, loaded.context_length
    inputs: list[PoolingInput] = []
    if loaded.task == "score":
        for index, pair in enumerate(request.pairs):
            where = f"pairs[{index}]"
            if not pair.text_1 or not pair.text_2:
                raise InvalidRequest(f"{where}: both texts must be non-empty", param=where)
            encoded = tokenizer(pair.text_1, pair.text_2)
            ids = list(encoded["input_ids"])
            _check_length(len(ids), limit, where)
            segments = encoded.get("token_type_ids")
            inputs.append(PoolingInput(tuple(ids), tuple(segments) if segments is not None else None))
        return PoolingWork(inputs)
    for side in ("text_1", "text_2"):
        for index, pair in enumerate(request.pairs):
            where = f"pairs[{index}].{side}"
            ids = _encode(tokenizer, getattr(pair, side), where)
            _check_length(len(ids), limit, where)
            inputs.append(PoolingInput(tuple(ids)))
    return PoolingWork(inputs, pairs=len(request.pairs))


def embed_response(
    loaded: LoadedModel, work: PoolingWork, rows: torch.Tensor, worker_id: str
) -> pb.EmbedResponse:
    assert loaded.pooling is not None
    vectors = finish_vectors(rows, loaded.pooling, work.dimensions)
    return pb.EmbedResponse(
        embeddings=[
            pb.EmbedVector(values=vector.tolist(), prompt_tokens=len(item.token_ids))
            for vector, item in zip(vectors, work.inputs, strict=True)
        ],
        prompt_tokens=work.prompt_tokens,
        model=loaded.model_id,
        worker_id=worker_id,
    )


def score_response(
    loaded: LoadedModel, work: PoolingWork, rows: torch.Tensor, worker_id: str
) -> pb.ScoreResponse:
    if work.pairs:  # an embedder: the cosine of each pair's two vectors
        first, second = rows[: work.pairs].float(), rows[work.pairs :].float()
        scores = torch.nn.functional.cosine_similarity(first, second, dim=-1)
    else:
        scores = rows[:, 0]
    return pb.ScoreResponse(
        scores=scores.tolist(), prompt_tokens=work.prompt_tokens, model=loaded.model_id, worker_id=worker_id
    )


def _encode(tokenizer: Any, text: str, where: str) -> list[int]:
    if not text:
        raise InvalidRequest(f"{where}: the text is empty", param=where)
    return list(tokenizer(text)["input_ids"])


def _check_count(count: int, param: str) -> None:
    if not 1 <= count <= MAX_POOLED_INPUTS:
        raise InvalidRequest(f"{param}: give 1 to {MAX_POOLED_INPUTS}, got {count}", param=param)


def _check_length(tokens: int, limit: int, where: str) -> None:
    if tokens > limit:
        raise InvalidRequest(
            f"{where} has {tokens} tokens; this model takes at most {limit}; shorten it", param=where
        )
