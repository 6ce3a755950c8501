"""What a pooling model (``--task embed`` or ``score``) is, read from its folder: the task ``auto``
picks, the pooling mode, normalisation, longest input and Matryoshka sizes; and the pooling itself.

Design notes: docs/worker.md, "Embeddings and scores".
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

TASKS = ("generate", "embed", "score")
POOLING_MODES = ("cls", "mean", "max", "last")
# sentence-transformers' modules a folder may list; any other (Dense, ...) is refused at load.
_SENTENCE_MODULES = {"Transformer": "transformer", "Pooling": "pooling", "Normalize": "normalize"}
# 1_Pooling/config.json's switches, by the mode they select.
_POOLING_SWITCHES = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_lasttoken": "last",
}


class PoolingConfigError(ValueError):
    """The folder's pooling setup is one the worker cannot serve (the message says why)."""


@dataclass(frozen=True)
class PoolingSpec:
    """How a model's final hidden states become one vector (embed) or a score (score)."""

    task: str  # "embed" or "score"
    mode: str = "last"  # one of POOLING_MODES (embed only)
    normalize: bool = True
    max_length: int | None = None  # the longest input the model takes (None: its context length)
    matryoshka_dimensions: tuple[int, ...] = ()  # smaller sizes the model was trained to serve


def _modules(folder: Path) -> list[dict[str, Any]] | None:
    path = folder / "modules.json"
    if not path.is_file():
        return None
    modules = json.loads(path.read_text())
    return modules if isinstance(modules, list) else None


def _architectures(folder: Path) -> list[str]:
    config = json.loads((folder / "config.json").read_text()) if (folder / "config.json").is_file() else {}
    return [str(name) for name in config.get("architectures") or []]


def detect_task(folder: Path | None) -> str:
    """``--task auto``: a sentence-transformers folder with a Pooling module embeds, a
    sequence-classification head scores, anything else generates."""
    if folder is None:
        return "generate"
    modules = _modules(folder) or []
    if any(str(m.get("type", "")).endswith(".Pooling") for m in modules):
        return "embed"
    if any(name.endswith("ForSequenceClassification") for name in _architectures(folder)):
        return "score"
    return "generate"


def read_spec(task: str, folder: Path | None, config: Any) -> PoolingSpec:
    """The pooling of a model served for ``task``: a sentence-transformers folder's own modules
    (``modules.json``, ``1_Pooling/config.json``, ``sentence_bert_config.json``); otherwise, as vLLM
    does, last-token pooling, normalised. Raises :class:`PoolingConfigError`."""
    matryoshka = tuple(int(d) for d in getattr(config, "matryoshka_dimensions", None) or ())
    if task == "score":
        labels = int(getattr(config, "num_labels", 1) or 1)
        if labels != 1:
            raise PoolingConfigError(
                f"--task score needs a classifier with one label (a cross-encoder); this one has {labels}"
            )
        return PoolingSpec("score", normalize=False)
    modules = _modules(folder) if folder is not None else None
    if modules is None:
        return PoolingSpec("embed", "last", True, None, matryoshka)
    kinds = []
    for module in modules:
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        if kind not in _SENTENCE_MODULES:
            raise PoolingConfigError(
                f"the sentence-transformers module {kind!r} ({module.get('path')}) is not supported; "
                "only Transformer, Pooling and Normalize are"
            )
        kinds.append((kind, str(module.get("path", ""))))
    pooling_path = next((path for kind, path in kinds if kind == "Pooling"), None)
    mode = "last"
    if pooling_path is not None and folder is not None:
        mode = _pooling_mode(json.loads((folder / pooling_path / "config.json").read_text()))
    max_length = None
    if folder is not None and (folder / "sentence_bert_config.json").is_file():
        max_length = json.loads((folder / "sentence_bert_config.json").read_text()).get("max_seq_length")
    return PoolingSpec(
        "embed",
        mode,
        any(kind == "Normalize" for kind, _ in kinds),
        int(max_length) if max_length else None,
        matryoshka,
    )


def _pooling_mode(config: dict[str, Any]) -> str:
    chosen = [mode for switch, mode in _POOLING_SWITCHES.items() if config.get(switch)]
    others = [
        k for k, v in config.items() if k.startswith("pooling_mode_") and v and k not in _POOLING_SWITCHES
    ]
    if others or len(chosen) != 1:
        raise PoolingConfigError(
            "1_Pooling/config.json must turn on exactly one of "
            f"{', '.join(_POOLING_SWITCHES)}; it turns on {', '.join(chosen + others) or 'none'}"
        )
    return chosen[0]


def pool(hidden: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """``hidden`` [batch, tokens, size] and its ``mask`` [batch, tokens] (1 = a real token, padding
    on the right) → [batch, size] by ``mode``."""
    weights = mask.to(hidden.dtype).unsqueeze(-1)
    if mode == "cls":
        return hidden[:, 0]
    if mode == "mean":
        return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
    if mode == "max":
        return hidden.masked_fill(weights == 0, torch.finfo(hidden.dtype).min).amax(1)
    if mode == "last":
        last = mask.long().sum(1) - 1
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    raise ValueError(f"unknown pooling mode {mode!r}")


def finish_vectors(pooled: torch.Tensor, spec: PoolingSpec, dimensions: int = 0) -> torch.Tensor:
    """Float32 vectors as served: cut to ``dimensions`` (0: all), then normalised when the model is."""
    vectors = pooled.float()
    if dimensions:
        vectors = vectors[:, :dimensions]
    if spec.normalize:
        vectors = torch.nn.functional.normalize(vectors, p=2, dim=-1)
    return vectors
