"""The messages of the engine process's pipe (worker/engine/process.py): one frozen dataclass per kind,
each side dispatching with ``match``; ``ToEngine`` goes to the engine process, ``FromEngine`` back.

Design notes (and why not ``worker/types.py``): docs/worker.md ("The engine in its own process").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from worker.engine.stats import EngineStats
from worker.errors import GenerationFailed, WorkerError
from worker.model.loader import LoadedModel
from worker.types import CoreOutput, FinishReason, GenerationRequest


@dataclass(frozen=True)
class ModelConfig:
    """What the serving process keeps of the model: its configs (family, vision, end tokens)."""

    config: Any
    generation_config: Any = None


@dataclass(frozen=True)
class ModelFacts:
    """What the engine process hands the serving process once loaded: the model without its weights
    (tokenizer, configs, processor), its end tokens and the engine's running limit."""

    loaded: LoadedModel
    eos_token_ids: frozenset[int]
    max_running: int


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why the engine process refused a request, for the serving process to raise again: the
    error's kind (a :class:`WorkerError` built from message, param and retry) and its fields."""

    kind: type[WorkerError]
    message: str
    param: str | None = None
    retry_after_seconds: float | None = None

    @classmethod
    def of(cls, error: WorkerError) -> Refusal:
        """The refusal for ``error``; a kind with another constructor crosses as GenerationFailed."""
        kind = type(error) if type(error).__init__ is WorkerError.__init__ else GenerationFailed
        return cls(kind, error.message, error.param, error.retry_after_seconds)

    def error(self) -> WorkerError:
        return self.kind(self.message, param=self.param, retry_after_seconds=self.retry_after_seconds)


# ------------------------------------------------------------------ serving process -> engine process


@dataclass(frozen=True, slots=True)
class Submit:
    """Prepare and queue ``request`` under ``key`` (answered by :class:`Acked`)."""

    key: str
    request: GenerationRequest


@dataclass(frozen=True, slots=True)
class Abort:
    """Remove the request (queued, running, or still being prepared): cancelled, or ``failed``."""

    key: str
    failed: bool = False


@dataclass(frozen=True, slots=True)
class StopChoices:
    """End these choices of the request (a stop string was found in their text)."""

    key: str
    choices: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Stop:
    """Stop the engine and exit (after the drain); from another serving process's pipe: that
    process is leaving, its pipe closes."""


@dataclass(frozen=True, slots=True)
class Attach:
    """``count`` more serving processes (``--api-server-count``): the ends of their pipes follow this
    message on the pipe as passed descriptors; each hears :class:`Ready` on its own."""

    count: int


ToEngine = Submit | Abort | StopChoices | Stop | Attach


# ------------------------------------------------------------------ engine process -> serving process


@dataclass(frozen=True, slots=True)
class Loading:
    """The model's load reached ``fraction`` (0..1)."""

    fraction: float


@dataclass(frozen=True, slots=True)
class LoadFailed:
    """The model could not be loaded (or cannot be served from a process of its own)."""

    message: str


@dataclass(frozen=True, slots=True)
class Ready:
    """The engine runs: the model's facts, and the engine's first stats (a scrape never lacks them)."""

    facts: ModelFacts
    stats: EngineStats


@dataclass(frozen=True, slots=True)
class Acked:
    """The answer to a :class:`Submit`: queued (no refusal, not ended), refused, or ended at once by
    its resumed tokens (``ended``: how)."""

    key: str
    refusal: Refusal | None = None
    ended: FinishReason | None = None


@dataclass(frozen=True, slots=True)
class Outputs:
    """One step's outputs for every request it touched, by key; ``stats``: the engine's stats, when a
    newer copy was waiting to be sent (a step that ends a request carries the copy that counts it)."""

    batches: list[tuple[str, list[CoreOutput]]]
    stats: EngineStats | None = None


@dataclass(frozen=True, slots=True)
class StatsReport:
    """The engine's stats, published without outputs (it ran out of work, or its copy was due)."""

    stats: EngineStats


@dataclass(frozen=True, slots=True)
class EngineFailed:
    """The engine could not go on (its device failed, or an :class:`EngineFailure`): it failed
    every request and stopped."""

    message: str


FromEngine = Loading | LoadFailed | Ready | Acked | Outputs | StatsReport | EngineFailed
