"""What the two OpenAI stream translators (chat, completions) share: the chunk envelope, the
usage options, the closing usage chunk and the mid-stream error payload."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from edge.errors import EdgeError
from edge.surfaces.shared.usage import UsageTracker


class StreamEnvelope:
    """The envelope of every streamed chunk of one response, built once per response.

    Every chunk is ``{id, object, created, model, <extra>, choices}`` plus
    ``usage``: the running usage with ``continuous_usage_stats``, ``null``
    with ``include_usage``, else absent. The shared fields are fixed at
    construction and copied into each chunk (a dict copy keeps their order,
    which is the wire order), so a chunk costs one small copy instead of
    rebuilding them for every token.
    """

    __slots__ = ("_continuous_usage", "_head", "_include_usage", "_usage")

    def __init__(
        self,
        *,
        object_name: str,
        completion_id: str,
        created: int,
        model: str,
        usage: UsageTracker,
        include_usage: bool,
        continuous_usage: bool,
        **extra: Any,
    ) -> None:
        self._head: dict[str, Any] = {
            "id": completion_id,
            "object": object_name,
            "created": created,
            "model": model,
            **extra,
        }
        self._usage = usage
        self._include_usage = include_usage
        self._continuous_usage = continuous_usage

    def chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        """One chunk holding ``choices`` (a new dict; the caller may add to it)."""
        chunk = self._head.copy()
        chunk["choices"] = choices
        if self._continuous_usage:
            chunk["usage"] = self._usage.running()
        elif self._include_usage:
            chunk["usage"] = None
        return chunk


@dataclass
class ChunkStream:
    """The base of an OpenAI translator: ``id``, ``created`` and ``model`` of every chunk, the usage
    options, and the envelope a subclass opens in ``__post_init__`` (:meth:`_open_envelope`)."""

    id: str
    created: int
    model: str
    include_usage: bool = False
    continuous_usage: bool = False
    logprobs: bool = False
    usage: UsageTracker = field(default_factory=UsageTracker)
    _envelope: StreamEnvelope = field(init=False, repr=False, compare=False)

    def _open_envelope(self, object_name: str, **extra: Any) -> None:
        # The fields every chunk shares are read once, here (on_event runs once per token).
        self._envelope = StreamEnvelope(
            object_name=object_name,
            completion_id=self.id,
            created=self.created,
            model=self.model,
            usage=self.usage,
            include_usage=self.include_usage,
            continuous_usage=self.continuous_usage,
            **extra,
        )

    def _body(self, object_name: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        """The non-streamed answer: ``id``, ``object``, ``created``, ``model``, ``extra``, the
        ``choices`` and the total ``usage``."""
        head = {"id": self.id, "object": object_name, "created": self.created, "model": self.model}
        return {**head, **extra, "choices": choices, "usage": self.usage.final()}

    def finish(self) -> list[dict[str, Any]]:
        """The chunks after the last event of every call: the usage chunk when ``include_usage``."""
        if not self.include_usage:
            return []
        chunk = self._envelope.chunk([])
        chunk["usage"] = self.usage.final()
        return [chunk]

    def on_error(self, error: EdgeError) -> list[dict[str, Any]]:
        """A failure after the stream began: OpenAI's error payload (framed as ``event: error``)."""
        return [error.payload()]
