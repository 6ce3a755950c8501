"""Starting queued requests, chunked prefill and preemption over the paged KV cache.

Design notes: docs/worker.md.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Tokens
from dataclasses import dataclass, field, replace
from typing import Any, Generic, Protocol, TypeVar, overload

from worker.engine.kv_blocks import BlockManager, SequenceBlocks
from worker.engine.policy import Policy, Room
from worker.engine.state_slots import Checkpoints, StateSlots
from worker.errors import InvalidRequest, QueueFull
from worker.model.step_inputs import Work, work_of
from worker.types import LoraHandle, PromptImage, Scheduling


@dataclass(eq=False)
class SeqState:
    """One choice's tokens and KV blocks. ``tokens`` grows by one per sample (the engine appends)."""

    tokens: list[int]
    prompt_length: int
    max_length: int  # prompt + max_tokens, capped at the context: the most tokens it can reach
    blocks: SequenceBlocks = field(default_factory=SequenceBlocks)
    computed: int = 0  # leading tokens whose KV is in the pool
    finished: bool = False
    awaits_prompt: bool = False  # an n > 1 sibling before the first sequence's prompt is done
    cached_tokens: int = 0  # prompt tokens the prefix cache supplied at its first start
    started: bool = False  # started at least once (a preempted sequence starts again)
    images: tuple[PromptImage, ...] = ()  # a vision-language prompt's images (their placeholder spans)
    state_slot: int = -1  # its slot of a hybrid model's state pool while it runs (-1: none)
    resume_from: int = -1  # the state checkpoint its attached prefix ends at, for its next work
    lora: LoraHandle | None = None  # its request's LoRA adapter (None: the base model)

    @property
    def cache_keys(self) -> Tokens[int]:
        """What the prefix cache keys this sequence's blocks by: its tokens, with each image's
        placeholders replaced by the image's key (so blocks of one image match only that image),
        and under a LoRA adapter the first token keyed with the adapter's load (so no prefix
        computed under one adapter, or the base model, serves another)."""
        if self.images or self.lora is not None:
            return _KeyedTokens(self.tokens, self.images, None if self.lora is None else self.lora.uid)
        return self.tokens

    def chunk(self, count: int) -> int:
        """``count`` prompt tokens from ``computed`` on, moved so the chunk never ends inside an image's
        placeholders: back to the image's start, or (a chunk that starts in it) on to its end."""
        end = self.computed + count
        if count <= 0:
            return count
        for image in self.images:
            if image.start < end < image.end:
                return (
                    image.start - self.computed if image.start > self.computed else image.end - self.computed
                )
        return count

    @property
    def table(self) -> list[int]:
        """Its block table (the pool blocks its tokens' KV goes to, in order)."""
        return self.blocks.table

    @property
    def pending(self) -> int:
        """Known tokens without KV yet (1 for a decoding sequence)."""
        return len(self.tokens) - self.computed

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_length


class Schedulable(Protocol):
    @property
    def request_id(self) -> str: ...

    @property
    def sequences(self) -> list[SeqState]: ...

    @property
    def needs_kv(self) -> bool:
        """False for a request that only scores its prompt (no sequence is computed)."""
        ...

    @property
    def scheduling(self) -> Scheduling:
        """Its priority, tenant and deadline, which the policy orders by."""
        ...


T = TypeVar("T", bound=Schedulable)


class StepPlan(Generic[T]):
    """One step: the work of every sequence that runs, the requests that started (left the queue
    for the batch, first time or after a preemption), those preempted, and those whose planning
    raised (to fail alone). (Not a generic dataclass: mypyc cannot compile one, docs/shared.md.)"""

    def __init__(self) -> None:
        self.work: list[Work] = []
        self.started: list[T] = []
        self.preempted: list[T] = []
        self.failed: list[tuple[T, Exception]] = []

    @property
    def empty(self) -> bool:
        return not self.work and not self.started


class SchedulingFailed(Exception):
    """:meth:`Scheduler.schedule` raised (``error``, also the ``__cause__``). ``failed``: the requests
    the call had already taken out of the queue because their own start raised, with their
    errors, as the plan's ``failed`` would have listed them; the caller must fail them too."""

    def __init__(self, failed: list[tuple[Any, Exception]], error: Exception):
        super().__init__(f"planning the step failed: {type(error).__name__}: {error}")
        self.failed = failed
        self.error = error


# A running request's decoding sequence and the most tokens it may propose: its proposals (or []).
Proposer = Callable[[T, SeqState, int], list[int]]


class Scheduler(Generic[T]):
    """Continuous batching with chunked prefill and preemption over a block pool, in the order of a
    :class:`~worker.engine.policy.Policy` (first come, first served by default)."""

    def __init__(
        self,
        blocks: BlockManager,
        *,
        max_running: int,
        max_queue: int,
        prefill_budget_tokens: int,
        propose: Proposer[T] | None = None,
        speculate_max_rows: int | None = None,
        checkpoints: int = 0,
        policy: Policy | None = None,
    ):
        """``propose``: speculative decoding's proposals for decoding sequences (None: off); they
        take what the step's token budget and free blocks have left after the running sequences
        and starts (a row's own token counts too), so they delay or preempt nobody; and only
        in steps where at most ``speculate_max_rows`` sequences decode (None: any number).
        ``checkpoints``: a hybrid model's state checkpoints (0: none; prefixes are then reused only
        by a model without recurrent state, see :class:`Checkpoints`). ``policy``: which waiting
        request starts next and which running one yields (None: first come, first served)."""
        self.policy = policy or Policy()
        self.propose = propose
        self.speculate_max_rows = speculate_max_rows
        self.blocks = blocks
        self.max_running = max_running
        self.max_queue = max_queue
        self.prefill_budget_tokens = prefill_budget_tokens
        self.waiting: deque[T] = deque()
        self.running: list[T] = []
        # Every planned sequence holds a state slot (a hybrid model's runner reads it; others ignore it).
        self.states = StateSlots(max_running)
        self.checkpoints: Checkpoints | None = None
        if checkpoints and blocks.prefix_caching:
            self.checkpoints = Checkpoints(checkpoints, blocks.block_size)
            blocks.resumable = self.checkpoints.resumable
            blocks.forgotten = self.checkpoints.forget

    @property
    def running_sequences(self) -> int:
        return sum(not seq.finished for item in self.running for seq in item.sequences)

    def _free_slots(self) -> int:
        return self.max_running - self.running_sequences

    @property
    def room(self) -> Room:
        return Room(self.max_running, self.prefill_budget_tokens)

    @property
    def capacity_tokens(self) -> int:
        return self.blocks.num_blocks * self.blocks.block_size

    def add(self, item: T) -> None:
        """Queues a request.

        Raises InvalidRequest when the request could never fit the pool on its
        own, QueueFull (with a retry hint) when the queue is at its bound, and what the policy's
        ``admit`` raises (DeadlineUnreachable).
        """
        if len(item.sequences) > self.max_running:  # it could never start: nothing behind it would
            raise InvalidRequest(
                f"the request asks for {len(item.sequences)} choices; this worker runs at most "
                f"{self.max_running} sequences at once; lower n",
                param="n",
            )
        need = sum(self.blocks.blocks_for(seq.max_length) for seq in item.sequences) if item.needs_kv else 0
        if need > self.blocks.num_blocks:
            tokens = sum(seq.max_length for seq in item.sequences)
            raise InvalidRequest(
                f"the request needs {tokens} tokens of KV cache (prompt + max_tokens, times n), more than "
                f"this worker's {self.capacity_tokens}; lower max_tokens or n",
                param="max_tokens",
            )
        # Requests the next step will start into free slots are not waiting for a slot: only the rest
        # count against the queue's bound (so the bound does not depend on when the step runs).
        # (The running batch is counted only once the queue is at its bound: it costs O(batch).)
        waiting = len(self.waiting)
        if waiting >= self.max_queue and waiting >= self.max_queue + max(0, self._free_slots()):
            raise QueueFull(
                f"the worker's queue is full ({self.max_queue} requests waiting); retry later",
                retry_after_seconds=1.0,
            )
        self.policy.admit(item, self.waiting, self.running, self.room)
        self.waiting.append(item)
        self.policy.added(item)

    def remove(self, request_id: str) -> T | None:
        """Takes a request out wherever it is (queued or running), freeing its blocks; returns it,
        or None if unknown."""
        for index, item in enumerate(self.running):
            if item.request_id == request_id:
                self._free(item)
                self.policy.forget(item)
                return self.running.pop(index)
        for index, item in enumerate(self.waiting):
            if item.request_id == request_id:
                del self.waiting[index]
                self._free(item)
                self.policy.forget(item)
                return item
        return None

    def finish(self, seq: SeqState) -> None:
        """A sequence ended: its blocks go back (registered prefix blocks stay reusable)."""
        seq.finished = True
        self.blocks.free(seq.blocks)
        self._give_slot(seq)

    def committed(self, work: Work, accepted: int = 0) -> None:
        """Records that ``work`` ran: its tokens' KV is in the pool (and whole blocks registered);
        with proposals, call it once the first ``accepted`` of them are in ``seq.tokens``. The KV of
        rejected proposals stays behind ``computed`` (overwritten later) and the blocks only they
        took go back."""
        seq = work.seq
        seq.computed += work.count + accepted
        self.blocks.commit(seq.blocks, seq.cache_keys, seq.computed)
        if work.state_to >= 0 and self.checkpoints is not None:
            reached = seq.blocks.registered * self.blocks.block_size == seq.computed
            self.checkpoints.bind(work.state_to, seq.blocks.chain_id if reached else None)
        if work.proposed:
            self.blocks.truncate(seq.blocks, seq.computed)

    def _free(self, item: T) -> None:
        for seq in item.sequences:
            self.blocks.free(seq.blocks)
            seq.computed = 0
            seq.resume_from = -1
            self._give_slot(seq)

    def _give_slot(self, seq: SeqState) -> None:
        self.states.give(seq.state_slot)
        seq.state_slot = -1

    def _work(self, seq: SeqState, count: int) -> Work:
        """``seq``'s part of the step (:func:`work_of`), with a state slot taken if it holds none,
        and the checkpoint its attached prefix resumes from (once)."""
        if seq.state_slot < 0:
            seq.state_slot = self.states.take()
        work = work_of(seq, count)
        if seq.resume_from >= 0:
            work = replace(work, state_from=seq.resume_from)
            seq.resume_from = -1
        return work

    def _attach(self, seq: SeqState) -> None:
        """Starts ``seq`` on its longest reusable cached prefix (for a hybrid model, one that ends
        at a state checkpoint, which its first work resumes from)."""
        seq.computed = self.blocks.attach_prefix(seq.blocks, seq.cache_keys)
        if seq.computed and self.checkpoints is not None:
            seq.resume_from = self.checkpoints.of(seq.blocks.chain_id)

    def _count(self, seq: SeqState, budget: int) -> int:
        """How many of ``seq``'s tokens its work computes within ``budget``: one for a decoding
        sequence, else a prompt chunk, cut at the next state checkpoint boundary (hybrid models)."""
        if seq.pending == 1:
            return 1
        count = seq.chunk(min(seq.pending, budget))
        if count > 0 and self.checkpoints is not None:
            cut = self.checkpoints.boundary(seq.computed, seq.computed + count, seq.prompt_length)
            if cut is not None:
                count = cut - seq.computed
        return count

    def _checkpoint(self, plan: StepPlan[T]) -> None:
        """Reserves a state checkpoint for each prompt chunk that ends at a boundary."""
        if self.checkpoints is None:
            return
        self.checkpoints.new_schedule()
        for index, work in enumerate(plan.work):
            seq = work.seq
            end = work.start + work.count
            if work.proposed or end > seq.prompt_length:
                continue  # checkpoints are taken in a prompt only
            if self.checkpoints.is_boundary(end, seq.prompt_length):
                checkpoint = self.checkpoints.reserve()
                if checkpoint >= 0:
                    plan.work[index] = replace(work, state_to=checkpoint)

    def schedule(self) -> StepPlan[T]:
        """Plans the next step: the running requests (oldest first), then starts, then
        proposals. A request whose own start raises leaves the queue for ``plan.failed``;
        when planning raises otherwise, :class:`SchedulingFailed` carries those requests (they are
        neither waiting nor running any more, so the caller fails them with the rest)."""
        plan: StepPlan[T] = StepPlan()
        self.policy.tick()
        try:
            self.policy.order_running(self.running)
            budget = self._plan_running(plan)
            budget = self._start_waiting(plan, budget)
            if self.propose is not None:
                self._speculate(plan, budget)
            self._checkpoint(plan)
        except Exception as error:
            raise SchedulingFailed(plan.failed, error) from error
        self.policy.planned(plan.work, self.running)
        return plan

    def _plan_running(self, plan: StepPlan[T]) -> int:
        """Plans every running request in the policy's order (first come: oldest first), preempting
        later ones for blocks; returns the budget left."""
        budget = self.prefill_budget_tokens
        index = 0
        while index < len(self.running):  # a preemption shortens the list from its end
            item = self.running[index]
            planned = len(plan.work)
            budget, ok = self._plan(item, budget, plan)
            if not ok:  # no block even after preempting every newer request: this one waits too
                del plan.work[planned:]
                self._preempt(item, plan, "blocks")
                continue
            index += 1
        return budget

    def _start_waiting(self, plan: StepPlan[T], budget: int) -> int:
        """Starts waiting requests in the policy's order while slots, budget and free blocks allow
        (a request short of slots or blocks may have the policy preempt running ones for it; one
        preempted so is not started again in this plan); returns the budget left."""
        yielded: set[int] = set()
        live = self.running_sequences  # counted once, then kept up to date: a full count is O(running)
        while self.waiting and (budget > 0 or not plan.work):
            index = self.policy.next_index(self.waiting, self.running, self.room)
            head = self.waiting[index]
            if id(head) in yielded:
                break
            if not adapters_fit(head, self.running):
                break
            started: bool | None = False  # short of slots: it waits unless one yields
            wanted = len(_live(head))
            if wanted + live <= self.max_running:
                budget, started = self._try_start(head, index, budget, plan)
                if started:
                    live += wanted
            if started is False:
                refund = self._yield_for(head, plan, yielded)
                if refund is None:
                    break
                budget += refund
                live = self.running_sequences  # a request left the running ones
        return budget

    def _try_start(self, head: T, index: int, budget: int, plan: StepPlan[T]) -> tuple[int, bool | None]:
        """Starts ``waiting[index]``; returns the budget left and whether it started (None: its own
        start raised, so it left the queue for ``plan.failed``)."""
        planned = len(plan.work)
        first = not any(seq.started for seq in head.sequences)
        try:
            budget, ok = self._start(head, budget, plan)
        except Exception as error:  # this request alone cannot be planned
            del self.waiting[index]
            plan.failed.append((head, error))  # listed first: reported even if freeing raises
            del plan.work[planned:]
            self.policy.forget(head)
            self._free(head)
            return budget, None
        if not ok:
            del plan.work[planned:]
            self._free(head)
            return budget, False
        del self.waiting[index]
        self.running.append(head)
        plan.started.append(head)
        if first:
            self.policy.started(head)
        return budget, True

    def _yield_for(self, head: T, plan: StepPlan[T], yielded: set[int]) -> int | None:
        """Preempts the running request the policy names for ``head`` (its planned work dropped);
        returns the prompt budget that work had taken, or None when the policy names none."""
        found = self.policy.victim(head, self.running, self.room)
        if found is None:
            return None
        victim, cause = found
        mine = {id(seq) for seq in victim.sequences}
        refund = sum(len(w.tokens) - w.proposed for w in plan.work if id(w.seq) in mine and w.seq.pending > 1)
        plan.work[:] = [w for w in plan.work if id(w.seq) not in mine]
        self._preempt(victim, plan, cause)
        yielded.add(id(victim))
        return refund

    def _plan(self, item: T, budget: int, plan: StepPlan[T]) -> tuple[int, bool]:
        """Plans a running request's sequences, preempting newer requests for blocks if needed."""
        for seq in _live(item):
            if seq.awaits_prompt:
                continue
            if not seq.blocks.table and seq.computed == 0:
                self._attach(seq)
            count = self._count(seq, budget)
            if count <= 0:
                continue
            while not self.blocks.ensure(seq.blocks, seq.computed + count):
                victim = self.running[-1]
                if victim is item:
                    return budget, False
                self._preempt(victim, plan, "blocks")
            plan.work.append(self._work(seq, count))
            if seq.pending > 1:
                budget -= count
        return budget, True

    def _speculate(self, plan: StepPlan[T], budget: int) -> None:
        """Gives the planned decoding sequences their proposals, oldest first, from what the budget
        and the free blocks have left once every running sequence and start is planned."""
        assert self.propose is not None
        decoding = sum(1 for work in plan.work if work.count == 1)
        if self.speculate_max_rows is not None and decoding > self.speculate_max_rows:
            return  # a large batch: one more token per row costs more than it saves
        planned = {id(work.seq): index for index, work in enumerate(plan.work)}
        for item in self.running:
            for seq in _live(item):
                index = planned.get(id(seq))
                if index is None or plan.work[index].count != 1 or seq.pending != 1:
                    continue
                proposals = self._proposals(item, seq, budget)
                if proposals:
                    plan.work[index] = work_of(seq, 1, proposals)
                    budget -= 1 + len(proposals)

    def _proposals(self, item: T, seq: SeqState, budget: int) -> tuple[int, ...]:
        """A decoding sequence's proposals that fit the budget (its own token included), its
        ``max_length`` and the free blocks (they never preempt); their blocks are taken here."""
        room = min(budget - 1, seq.max_length - len(seq.tokens))
        if self.propose is None or room <= 0:
            return ()
        proposals = tuple(self.propose(item, seq, room)[:room])
        if proposals and not self.blocks.ensure(seq.blocks, seq.computed + 1 + len(proposals)):
            return ()
        return proposals

    def _start(self, item: T, budget: int, plan: StepPlan[T]) -> tuple[int, bool]:
        """Plans a waiting request's first step; False (nothing taken) when its blocks are short.
        Only free blocks count: a start never preempts."""
        if not item.needs_kv:
            return budget, True
        others = bool(plan.work)  # work planned for other requests before this one
        own = False
        for seq in _live(item):
            if seq.awaits_prompt:
                continue
            self._attach(seq)
            count = self._count(seq, max(budget, 0))
            if count <= 0:
                if own:  # its own sequences took the budget: this one waits as a running sequence
                    continue
                if others:  # other requests took the budget: try again next step
                    return budget, False
                count = seq.chunk(min(seq.pending, self.prefill_budget_tokens))
            if not self.blocks.ensure(seq.blocks, seq.computed + count):
                return budget, False
            plan.work.append(self._work(seq, count))
            own = True
            if seq.pending > 1:
                budget -= count
        _count_cached(item)
        return budget, True

    def _preempt(self, item: T, plan: StepPlan[T], cause: str) -> None:
        """Frees a running request's blocks and puts it back at the front of the queue; ``cause``
        (blocks, priority, fairness) is counted."""
        self.running.remove(item)
        self._free(item)
        self.waiting.appendleft(item)
        self.policy.stats.preempted(cause)
        plan.preempted.append(item)
        if item in plan.started:
            plan.started.remove(item)


class _KeyedTokens(Tokens[int]):
    """A sequence's tokens as the prefix cache keys them (:attr:`SeqState.cache_keys`), read lazily."""

    def __init__(self, tokens: list[int], images: tuple[PromptImage, ...], adapter: int | None = None):
        self._tokens = tokens
        self._images = images
        self._adapter = adapter  # a LoRA adapter's uid: position 0 is keyed with it

    def __len__(self) -> int:
        return len(self._tokens)

    def _key(self, position: int) -> int:
        for image in self._images:
            if image.start <= position < image.end:
                return image.key
        if position == 0 and self._adapter is not None:
            return adapter_key(self._adapter, self._tokens[0])
        return self._tokens[position]

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> list[int]: ...
    def __getitem__(self, index: int | slice) -> int | list[int]:
        if isinstance(index, slice):
            return [self._key(p) for p in range(*index.indices(len(self._tokens)))]
        return self._key(index if index >= 0 else index + len(self._tokens))


def adapter_key(uid: int, token: int) -> int:
    """A sequence's first prefix-cache key under LoRA adapter ``uid``: above every token id (below
    2**32) and apart for each adapter, so its blocks chain apart from the base model's and others'."""
    return (uid << 32) | token


def adapters_fit(item: Schedulable, running: Iterable[Schedulable]) -> bool:
    """Whether ``item`` can start beside ``running`` within ``--max-loras`` (each step computes
    every running sequence, so the running set holds at most that many distinct adapters)."""
    adapter = next((seq.lora for seq in item.sequences), None)
    if adapter is None:
        return True
    held = {seq.lora.uid for other in running for seq in other.sequences if seq.lora is not None}
    return adapter.uid in held or len(held) < adapter.max_active


def _count_cached(item: Schedulable) -> None:
    """Records, at a request's first start that succeeds, the prompt tokens its sequences
    reused from the prefix cache: what they attached (``computed`` until the step commits). A
    start that found its blocks short attached and let go again, so it counts nothing."""
    for seq in _live(item):
        if not seq.awaits_prompt and not seq.started:
            seq.started = True
            seq.cached_tokens = min(seq.computed, seq.prompt_length)


def _live(item: Schedulable) -> list[SeqState]:
    return [seq for seq in item.sequences if not seq.finished]
