"""The host tier's copies on CUDA: issued on a side stream, ordered against the forwards by events,
so the host never waits for them (``--kv-offload-bytes``; the CPU path is HostKV's own).
Design: docs/worker.md, "The host tier".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch


class Copy(Protocol):
    """One queued block copy (worker/engine/host_tier.py): device ``block`` to host ``slot`` when
    ``to_host``, else back."""

    @property
    def to_host(self) -> bool: ...
    @property
    def block(self) -> int: ...
    @property
    def slot(self) -> int: ...


class Event(Protocol):
    """The part of ``torch.cuda.Event`` used here."""

    def record(self, stream: Any = None) -> None: ...


class Stream(Protocol):
    """The part of ``torch.cuda.Stream`` used here."""

    def wait_event(self, event: Any) -> None: ...


@dataclass(frozen=True)
class Streams:
    """Where the copies run: the forwards' stream (``compute``, read at each apply), the side
    stream, a new event, and a context making a stream current (torch.cuda's, or a test's fakes)."""

    compute: Callable[[], Stream]
    side: Stream
    event: Callable[[], Event]
    using: Callable[[Any], AbstractContextManager[Any]]


def cuda_streams(device: torch.device) -> Streams:
    """The device's current stream for the forwards and a dedicated stream for the copies."""
    return Streams(
        compute=lambda: torch.cuda.current_stream(device),
        side=torch.cuda.Stream(device),
        event=torch.cuda.Event,
        using=torch.cuda.stream,
    )


class SideCopies:
    """Runs queued copies between device blocks and pinned host slots on ``streams.side``: after
    the forwards queued so far (an event recorded on the compute stream: the blocks' last writes,
    and the last reads of a block about to be overwritten), one async copy per block and tensor
    in queue order, then an event the compute stream waits on before the next forward (a block
    brought back is whole before it is read; an evicted block is read before it is overwritten).
    One stream for both directions orders a slot's read-back after the copy that wrote it."""

    def __init__(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], streams: Streams):
        self.pairs = pairs
        self.streams = streams

    def apply(self, copies: Sequence[Copy]) -> None:
        """Queues ``copies`` (in order) on the side stream; returns without waiting for them."""
        compute = self.streams.compute()
        ready = self.streams.event()
        ready.record(compute)
        self.streams.side.wait_event(ready)
        with self.streams.using(self.streams.side):
            for copy in copies:
                for device, host in self.pairs:
                    if copy.to_host:
                        host[copy.slot].copy_(device[copy.block], non_blocking=True)
                    else:
                        device[copy.block].copy_(host[copy.slot], non_blocking=True)
        done = self.streams.event()
        done.record(self.streams.side)
        compute.wait_event(done)
