"""The tensor-parallel ranks in torch.distributed: joining them (gloo on the CPU, NCCL on CUDA), the
sum the shards' outputs take, and the control channel that carries rank 0's forwards to the others.

Design notes: docs/worker.md, "Tensor parallelism".
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from worker.lora.layers import LoraLayers
from worker.model.device import RankFailure
from worker.model.step_inputs import Work
from worker.parallel.adapters import told_handle, told_work
from worker.types import LoraHandle

log = logging.getLogger(__name__)

# How long a collective of a forward (an all-reduce) may wait for the other ranks.
COLLECTIVE_TIMEOUT = timedelta(seconds=60)
# How long the ranks wait for each other to join: a fresh interpreter's imports on a busy host, or
# another node's start, can take longer than a collective may.
JOIN_TIMEOUT = timedelta(minutes=10)
# How long a follower waits for rank 0's next forward (an idle worker sends none).
IDLE_TIMEOUT = timedelta(days=30)


@dataclass(frozen=True)
class Layout:
    """Where a rank stands: ``rank`` of ``ranks``, its device index on its node, and rank 0's
    rendezvous ``address`` (``host:port``)."""

    rank: int
    ranks: int
    local_rank: int
    address: str


@dataclass(frozen=True)
class Execute:
    """A forward of rank 0's step (:meth:`worker.model.runner.ModelRunner.execute`); an item's LoRA
    adapter carries its weights in the step that copies them into a slot (worker/parallel/adapters.py)."""

    work: list[Work]
    fed: torch.Tensor | None


@dataclass(frozen=True)
class Score:
    """A prompt's logprobs (:meth:`worker.model.runner.ModelRunner.score`), under ``lora``'s adapter."""

    prompt: list[int]
    top_n: int
    lora: LoraHandle | None = None


@dataclass(frozen=True)
class Accepted:
    """A hybrid model's verifying row kept ``kept`` of its proposals: every rank's state slot takes
    the state after them (:meth:`worker.model.runner.ModelRunner.accepted`)."""

    item: Work
    kept: int


@dataclass(frozen=True)
class Stop:
    """The worker is stopping: the followers exit."""


Message = Execute | Score | Accepted | Stop


def rendezvous_store(host: str, port: int, ranks: int) -> dist.TCPStore:
    """Rank 0's rendezvous store, listening on ``host:port`` (0: a free port) before any other rank
    starts: a rank that tries to connect before the store listens backs off for most of a minute."""
    return dist.TCPStore(host, port, ranks, is_master=True, timeout=JOIN_TIMEOUT, wait_for_workers=False)


def joined_key(rank: int) -> str:
    """The rendezvous store's key a rank sets once it has joined."""
    return f"sluice/joined/{rank}"


def wait_for_ranks(store: dist.Store, layout: Layout) -> None:
    """Marks this rank joined and waits (up to :data:`JOIN_TIMEOUT`) until every rank has, so that
    the process group's own rendezvous, whose timeout is a collective's, finds them all there."""
    store.set(joined_key(layout.rank), "1")
    store.wait([joined_key(rank) for rank in range(layout.ranks)], JOIN_TIMEOUT)


class RankGroup:
    """This process's membership of the ranks: the forwards' all-reduce on the default group (its
    timeout :data:`COLLECTIVE_TIMEOUT`), and a gloo control group (:data:`IDLE_TIMEOUT`) on which
    rank 0 broadcasts each forward before running it."""

    def __init__(self, layout: Layout, device: torch.device, store: dist.TCPStore | None = None):
        """``store``: rank 0's rendezvous store, listening already (:func:`rendezvous_store`); the
        other ranks connect to ``layout.address``."""
        self.layout = layout
        if store is None:
            host, port = layout.address.rsplit(":", 1)
            store = dist.TCPStore(host, int(port), layout.ranks, is_master=False, timeout=JOIN_TIMEOUT)
        wait_for_ranks(store, layout)
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend, store=store, rank=layout.rank, world_size=layout.ranks, timeout=COLLECTIVE_TIMEOUT
        )
        self._control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        log.info("tensor-parallel rank %d of %d joined (%s)", layout.rank, layout.ranks, backend)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sums ``tensor`` over the ranks in place; raises :class:`RankFailure` when it cannot."""
        try:
            dist.all_reduce(tensor)
        except Exception as error:
            raise RankFailure(f"a tensor-parallel all-reduce failed: {error}") from error

    def share(self, value: int) -> int:
        """Rank 0's ``value``, on every rank, once every rank is there (on the control group: no
        forward's timeout, as loads take their time)."""
        box: list[object] = [value]
        self._broadcast(box)
        shared = box[0]
        assert isinstance(shared, int), f"unexpected value {shared!r}"
        return shared

    def agree(self, value: int, what: str) -> None:
        """Raises :class:`RankFailure` unless every rank has the same ``value``."""
        values = self._gathered(value, what)
        if len(set(values)) != 1:
            raise RankFailure(f"tensor-parallel ranks disagree on {what}: {values}")

    def all_of(self, value: bool, what: str) -> bool:
        """Whether ``value`` holds on every rank (every rank gets the same answer)."""
        return all(self._gathered(value, what))

    def _gathered(self, value: object, what: str) -> list[object]:
        """Every rank's ``value``, in rank order (on the control group)."""
        values: list[object] = [None] * self.layout.ranks
        try:
            dist.all_gather_object(values, value, group=self._control)
        except Exception as error:
            raise RankFailure(f"tensor-parallel ranks could not compare {what}: {error}") from error
        return values

    def send(self, message: Message) -> None:
        """Rank 0: tells every other rank ``message``."""
        self._broadcast([message])

    def receive(self) -> Message:
        """A follower: rank 0's next message (waits up to :data:`IDLE_TIMEOUT`)."""
        box: list[object] = [None]
        self._broadcast(box)
        message = box[0]
        assert isinstance(message, Execute | Score | Accepted | Stop), f"unexpected message {message!r}"
        return message

    def _broadcast(self, box: list[object]) -> None:
        try:
            dist.broadcast_object_list(box, src=0, group=self._control)
        except Exception as error:
            raise RankFailure(f"the tensor-parallel control channel failed: {error}") from error

    def close(self) -> None:
        """Leaves the group (whatever state the others are in)."""
        try:
            dist.destroy_process_group()
        except Exception:  # a failed group may not shut down cleanly: the process is ending anyway
            log.debug("destroying the process group failed", exc_info=True)


class Relay:
    """Rank 0's side (:class:`worker.model.runner.Followers`): each forward, told to the followers
    before rank 0 runs it (its sequences left out; the fed ids on the host; an adapter's weights
    only when rank 0's ``lora`` slots lack it, so every rank fills the same slot in that step)."""

    def __init__(self, group: RankGroup, lora: LoraLayers | None = None):
        self._group = group
        self._lora = lora

    def execute(self, work: Sequence[Work], fed: torch.Tensor | None) -> None:
        self._group.send(Execute(told_work(work, self._lora), None if fed is None else fed.cpu()))

    def score(self, prompt: Sequence[int], top_n: int, lora: LoraHandle | None = None) -> None:
        self._group.send(Score(list(prompt), top_n, told_handle(lora, self._lora)))

    def accepted(self, item: Work, kept: int) -> None:
        self._group.send(Accepted(dataclasses.replace(item, seq=None, lora=None), kept))
