"""The adapters a worker serves by name: folders known, at most ``--max-cpu-loras`` held in host
memory (the others read again on demand), loaded and unloaded at run time. Thread-safe.

Design notes: docs/worker.md ("LoRA adapters").
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from worker.config import WorkerConfig
from worker.errors import InvalidRequest, ModelNotFound, WorkerError
from worker.lora.adapter import AdapterError, LoraWeights, read_adapter
from worker.types import LoraHandle


@dataclass
class _Entry:
    path: str
    uid: int
    weights: LoraWeights | None


class LoraRegistry:
    """Adapter names -> folders and their weights; ``targets``: the model's wrapped modules
    (worker/lora/layers.py), which every adapter is checked against when it is loaded."""

    def __init__(
        self,
        targets: Mapping[str, tuple[int, int]],
        *,
        served_model: str,
        max_loras: int,
        max_rank: int,
        max_cpu_loras: int,
        dtype: torch.dtype,
    ):
        self.targets, self.served_model = dict(targets), served_model
        self.max_loras, self.max_rank, self.max_cpu_loras = max_loras, max_rank, max(max_cpu_loras, 1)
        self.dtype = dtype
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._uids = itertools.count(1)
        self._lock = threading.Lock()

    def load(self, name: str, path: str, base_model_name: str | None = None) -> None:
        """Reads and checks the folder, then serves it as ``name``. Refuses (InvalidRequest,
        naming the problem) the base model's name, a name in use, another base model's adapter and
        any folder :func:`read_adapter` refuses."""
        if not name:
            raise InvalidRequest("a LoRA adapter needs a name", param="lora_name")
        if name == self.served_model:
            raise InvalidRequest(
                f"{name!r} is the base model's name; name the adapter otherwise", param="lora_name"
            )
        if base_model_name and base_model_name != self.served_model:
            raise AdapterError(
                f"LoRA adapter {name!r} is for base model {base_model_name!r}; this worker serves "
                f"{self.served_model!r}"
            )
        weights = read_adapter(path, self.targets, self.max_rank, self.dtype)
        with self._lock:
            if name in self._entries:
                raise InvalidRequest(f"LoRA adapter {name!r} is already loaded", param="lora_name")
            self._entries[name] = _Entry(path, next(self._uids), weights)
            self._trim()

    def unload(self, name: str) -> None:
        """Stops serving ``name`` (requests already holding it finish with it)."""
        with self._lock:
            if self._entries.pop(name, None) is None:
                raise ModelNotFound(f"LoRA adapter {name!r} is not loaded", param="lora_name")

    def knows(self, name: str) -> bool:
        with self._lock:
            return name in self._entries

    def names(self) -> list[tuple[str, str]]:
        """Each served adapter's ``(name, path)``, by name."""
        with self._lock:
            return sorted(((name, entry.path) for name, entry in self._entries.items()), key=lambda x: x[0])

    def resolve(self, name: str) -> LoraHandle:
        """The adapter a request names, read from its folder again if it left host memory.
        Raises :class:`ModelNotFound` for a name not served."""
        with self._lock:
            entry = self._entries.get(name)
            if entry is None:
                raise ModelNotFound(
                    f"model {name!r} is not served here (no base model or LoRA adapter of that name)",
                    param="model",
                )
            self._entries.move_to_end(name)
            weights = entry.weights
            if weights is None:
                weights = entry.weights = read_adapter(entry.path, self.targets, self.max_rank, self.dtype)
                self._trim()
            return LoraHandle(name, entry.uid, self.max_loras, weights)

    def _trim(self) -> None:
        """Drops the least recently used adapters' weights beyond ``max_cpu_loras`` (under the lock)."""
        held = [entry for entry in self._entries.values() if entry.weights is not None]
        for entry in held[: max(len(held) - self.max_cpu_loras, 0)]:
            entry.weights = None


def lora_registry(
    config: WorkerConfig, targets: Mapping[str, tuple[int, int]], served_model: str, dtype: torch.dtype
) -> LoraRegistry:
    """The registry of ``--enable-lora``, serving each of ``--lora-modules`` (checked as they load).
    Raises ValueError naming the first module refused, and why."""
    registry = LoraRegistry(
        targets,
        served_model=served_model,
        max_loras=config.max_loras,
        max_rank=config.max_lora_rank,
        max_cpu_loras=config.max_cpu_loras or config.max_loras,
        dtype=dtype,
    )
    for module in config.lora_modules:
        try:
            registry.load(module.name, module.path, module.base_model_name)
        except WorkerError as exc:
            raise ValueError(f"--lora-modules {module.name}: {exc.message}") from exc
    return registry
