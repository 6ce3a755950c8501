"""The scheduler and block manager under a simulated engine (no model), one seed per run: random
arrivals, ``n`` 1-3, stops (also while preempted), cancellations, scoring-only requests, admissions that
raise, shared prefixes, pools of 6-24 blocks and budgets down to one token; and, by seed, speculative
proposals (accepted in part, the rest rolled back), prompts with images (their spans keyed by the image
in the prefix cache) and overlapping steps (a placeholder token until the draw is read, the commit after
it); by seed too the scheduling policy (``fcfs``, ``priority``, ``fair``), with random priorities,
tenants and deadlines (refused at admission by a step clock). Every plan and step is checked
(docs/testing.md lists the checks), among them that a decoding sequence is never held back, that the
policy's next request is admitted when nothing else took the budget and slots and free blocks cover it,
and that no running request has a lower priority than a waiting one it could yield to; schedulers and
a policy broken on purpose show those checks fail. ``SLUICE_FUZZ_SCALE`` multiplies the seeds."""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from worker.engine.host_tier import HostTier
from worker.engine.kv_blocks import BlockManager
from worker.engine.policy import FairPolicy, Policy, PolicyName, PriorityPolicy, make_policy
from worker.engine.scheduler import Scheduler, SeqState, StepPlan
from worker.errors import DeadlineUnreachable, InvalidRequest, QueueFull
from worker.model.step_inputs import Work
from worker.types import PromptImage, Scheduling

SCALE = float(os.environ.get("SLUICE_FUZZ_SCALE", "1"))
SEEDS = range(int(10 * SCALE))
BROKEN_SEEDS = range(int(6 * SCALE))
STEPS = 400
IMAGE_TOKEN = 99  # every image's placeholder token (text tokens are 0-49); the key tells images apart
IMAGE_KEYS = (-11, -12)  # two images at most: the same one comes back often, the other at its place


@dataclass(eq=False)
class Request:
    request_id: str
    sequences: list[SeqState] = field(default_factory=list)
    needs_kv: bool = True
    scheduling: Scheduling = field(default_factory=Scheduling)


class Poisoned(SeqState):
    """A sequence whose cache keys raise: its request's admission raises (a bug planning it alone)."""

    @property
    def cache_keys(self):  # type: ignore[override]
        raise RuntimeError("poisoned")


@dataclass(frozen=True)
class Features:
    """What a seed simulates besides plain generation (every combination within six seeds)."""

    speculation: bool
    overlap: bool  # never with speculation (the engine refuses the pair)
    images: bool
    policy: PolicyName  # seeds 0-2 fcfs, 3-5 priority, 6-8 fair, ...
    host_slots: int  # --kv-offload-bytes: the host tier's blocks (0: off), on every other seed

    @classmethod
    def of(cls, seed: int) -> Features:
        policy = list(PolicyName)[seed // 3 % 3]
        slots = 0 if seed % 4 >= 2 else 1 + seed % 11
        return cls(
            speculation=seed % 3 == 1,
            overlap=seed % 3 == 2,
            images=seed % 2 == 1,
            policy=policy,
            host_slots=slots,
        )


class Simulation:
    """What the engine does around the scheduler, with random tokens instead of a model; ``pool``
    shadows the KV cache: the key (token or image) each block's slots were last computed for."""

    def __init__(
        self,
        seed: int,
        scheduler_class: type[Scheduler[Request]] = Scheduler,
        policy: Callable[[PolicyName, Callable[[], float]], Policy] = make_policy,
    ):
        self.rng = random.Random(seed)
        self.features = Features.of(seed)
        self.steps = 0  # the policy's clock: one second a step
        self.block_size = self.rng.choice([2, 4, 8])
        blocks = BlockManager(
            self.rng.randint(6, 24), self.block_size, prefix_caching=self.rng.random() < 0.8
        )
        if self.features.host_slots:
            blocks.tier = HostTier(self.features.host_slots, block_bytes=1)
        # The host tier's slots, shadowed like the pool: copies run (in order) before each forward.
        self.host: list[list[int | None]] = [
            [None] * self.block_size for _ in range(self.features.host_slots)
        ]
        speculate = self.features.speculation
        self.scheduler = scheduler_class(
            blocks,
            max_running=self.rng.randint(2, 8),
            max_queue=self.rng.randint(4, 16),
            prefill_budget_tokens=self.rng.choice([1, 3, self.block_size, 16, 64]),
            propose=self.propose if speculate else None,
            speculate_max_rows=self.rng.choice([None, 1, 2, 4]) if speculate else None,
            policy=policy(self.features.policy, lambda: float(self.steps)),
        )
        self.pool: list[list[int | None]] = [[None] * self.block_size for _ in range(blocks.num_blocks)]
        self.templates = [self.template() for _ in range(3)]
        self.ids = 0
        self.known: dict[str, Request] = {}  # every request the scheduler took
        self.owner: dict[int, Request] = {}  # id(sequence) -> its request
        self.ended: set[str] = set()  # finished or cancelled (out of the scheduler)
        self.failed: set[str] = set()  # in a plan's failed list
        self.admitted: set[str] = set()  # admitted at least once
        self.in_flight: list[tuple[SeqState, int]] = []  # overlap: each drawn row and its placeholder's place

    # ------------------------------------------------------------------ requests

    def template(self) -> tuple[list[int], list[tuple[int, int]]]:
        """A shared prompt start: 12 text tokens, with images one image's placeholders among them."""
        tokens = [self.rng.randrange(50) for _ in range(12)]
        if not self.features.images:
            return tokens, []
        start, length = self.rng.randint(0, 8), self.rng.randint(2, 6)
        tokens[start:start] = [IMAGE_TOKEN] * length
        return tokens, [(start, start + length)]

    def prompt(self) -> tuple[list[int], tuple[PromptImage, ...]]:
        """A template's start (never cutting an image), random text, and sometimes another image."""
        tokens, spans = self.rng.choice(self.templates)
        cut = self.rng.randint(1, len(tokens))
        images = []
        for start, end in spans:
            if start < cut:
                cut = max(cut, end)
                images.append(PromptImage(start, end, self.rng.choice(IMAGE_KEYS), {}))
        prompt = tokens[:cut] + [self.rng.randrange(50) for _ in range(self.rng.randint(0, 10))]
        if self.features.images and self.rng.random() < 0.3:
            start, length = len(prompt), self.rng.randint(2, 5)
            prompt += [IMAGE_TOKEN] * length + [self.rng.randrange(50) for _ in range(self.rng.randint(0, 3))]
            images.append(PromptImage(start, start + length, self.rng.choice(IMAGE_KEYS), {}))
        return prompt, tuple(images)

    def arrive(self) -> None:
        n = self.rng.randint(1, 3)
        prompt, images = self.prompt()
        longest = len(prompt) + self.rng.randint(1, 12)
        poisoned = self.rng.random() < 0.01
        needs_kv = poisoned or self.rng.random() < 0.97
        self.ids += 1
        kinds = [Poisoned if poisoned and i == 0 else SeqState for i in range(n)]
        request = Request(
            f"r{self.ids}",
            [
                kind(list(prompt), len(prompt), longest, awaits_prompt=i > 0, images=images)
                for i, kind in enumerate(kinds)
            ],
            needs_kv=needs_kv,
            scheduling=Scheduling(
                priority=self.rng.randint(0, 3),
                tenant=self.rng.choice(["t0", "t1", "t2"]),
                deadline=self.steps + self.rng.randint(2, 300) if self.rng.random() < 0.5 else None,
            ),
        )
        with contextlib.suppress(InvalidRequest, QueueFull, DeadlineUnreachable):
            self.scheduler.add(request)
            self.known[request.request_id] = request
            self.owner.update((id(seq), request) for seq in request.sequences)

    def propose(self, request: Request, seq: SeqState, room: int) -> list[int]:
        """Random proposals after a row's first token, sometimes more than ``room`` (cut by the scheduler)."""
        if seq.generated == 0 or self.rng.random() < 0.3:
            return []
        return [self.rng.randrange(50) for _ in range(self.rng.randint(1, 4))]

    def control(self) -> None:
        """Cancellations and stops, applied before planning as the engine does."""
        for request in [*self.scheduler.running, *self.scheduler.waiting]:
            roll = self.rng.random()
            if roll < 0.01:
                self.scheduler.remove(request.request_id)
                self.ended.add(request.request_id)
            elif roll < 0.04:
                live = [seq for seq in request.sequences if not seq.finished and seq.generated]
                if live:
                    self.scheduler.finish(self.rng.choice(live))
                    self.end_if_done(request)

    def end_if_done(self, request: Request) -> None:
        if all(seq.finished for seq in request.sequences):
            assert self.scheduler.remove(request.request_id) is request
            self.ended.add(request.request_id)

    # ------------------------------------------------------------------ steps

    def step(self) -> StepPlan[Request]:
        """Plans a step (checked before anything runs), runs it as the engine does, checks the state."""
        plan = self.scheduler.schedule()
        self.check_plan(plan)
        self.failed.update(request.request_id for request, _ in plan.failed)
        self.admitted.update(request.request_id for request in plan.started)
        for request in plan.started:
            if not request.needs_kv:  # a scoring-only request ends at admission
                for seq in request.sequences:
                    self.scheduler.finish(seq)
        self.run(plan.work)
        for request in list(self.scheduler.running):
            self.end_if_done(request)
        self.check_state()
        self.steps += 1
        return plan

    def run(self, work: list[Work]) -> None:
        """The forward, then the previous draw read (overlap), then the commit, then the draws."""
        self.resolve()  # a row it ends goes no further: its forward's work is dropped
        self.copy()
        work = [w for w in work if not w.seq.finished and self.owner[id(w.seq)].request_id not in self.ended]
        sampled = [item for item in work if item.sample]  # read before the commit moves ``computed``
        for item in work:
            self.write(item)
            if not item.proposals:
                self.scheduler.committed(item)
                assert min(item.seq.tokens[: item.seq.computed]) >= 0, "a placeholder was committed"
        for item in sampled:
            if item.proposals:
                self.verify(item)
            else:
                self.draw(item.seq)
        if not self.features.overlap:
            self.resolve()

    def copy(self) -> None:
        """The host tier's queued copies, in order, as the runner's wrapper runs them."""
        tier = self.scheduler.blocks.tier
        for copy in tier.drain() if tier is not None else []:
            if copy.to_host:
                self.host[copy.slot] = list(self.pool[copy.block])
            else:
                self.pool[copy.block] = list(self.host[copy.slot])

    def write(self, work: Work) -> None:
        """The forward's KV writes: its tokens' (:func:`key`) and its proposals', into blocks the
        sequence alone holds and the prefix cache does not list."""
        seq, blocks, size = work.seq, self.scheduler.blocks, self.block_size
        values = [key(seq, p) for p in range(seq.computed, seq.computed + work.count)] + list(work.proposals)
        for offset, value in enumerate(values):
            place = seq.computed + offset
            block = seq.blocks.table[place // size]
            assert blocks._refs[block] == 1 and block not in blocks._by_block, "a step wrote a shared block"
            self.pool[block][place % size] = value

    def draw(self, seq: SeqState) -> None:
        """The row's next token (the prompt's end: its waiting siblings' first ones too); with overlap a
        placeholder until :meth:`resolve`."""
        rows = [seq]
        if seq.generated == 0:
            rows += [s for s in self.owner[id(seq)].sequences if s.awaits_prompt]
        for row in rows:
            row.awaits_prompt = False
            if self.features.overlap:
                self.in_flight.append((row, len(row.tokens)))
                row.tokens.append(-len(self.in_flight))
            else:
                row.tokens.append(self.rng.randrange(50))
                self.maybe_finish(row)

    def resolve(self) -> None:
        """Reads the draw in flight: each row still going gets its token in its placeholder's place."""
        drawn, self.in_flight = self.in_flight, []
        for seq, place in drawn:
            request = self.owner[id(seq)].request_id
            if not (seq.finished or request in self.ended or request in self.failed):
                seq.tokens[place] = self.rng.randrange(50)
                self.maybe_finish(seq)

    def verify(self, work: Work) -> None:
        """Accepts a random share of the proposals, draws one more token, commits what the row kept."""
        seq, kept = work.seq, 0
        for proposal in work.proposals:
            if self.rng.random() < 0.4:  # rejected: the draw differs
                seq.tokens.append((proposal + 1) % 50)
                break
            seq.tokens.append(proposal)
            kept += 1
            if self.maybe_finish(seq):
                return
        else:
            seq.tokens.append(self.rng.randrange(50))
        if not self.maybe_finish(seq):
            self.scheduler.committed(work, accepted=kept)

    def maybe_finish(self, seq: SeqState) -> bool:
        if len(seq.tokens) >= seq.max_length or self.rng.random() < 0.03:
            self.scheduler.finish(seq)
            return True
        return False

    # ------------------------------------------------------------------ checks

    def check_plan(self, plan: StepPlan[Request]) -> None:
        """The plan, before anything runs."""
        scheduler = self.scheduler
        if scheduler.waiting or scheduler.running:
            assert plan.work or plan.started or plan.failed, "work is waiting but the step planned nothing"
        running = {id(seq) for request in scheduler.running for seq in request.sequences}
        planned = [id(w.seq) for w in plan.work]
        assert len(planned) == len(set(planned)), "a sequence was planned twice"
        for work in plan.work:
            self.check_work(work, running)
        self.check_never_held_back(plan)
        self.check_head_admitted(plan)
        self.check_priority(plan)
        self.check_speculation(plan)
        self.check_cached_tokens(plan)
        for request, _ in plan.failed:
            assert isinstance(request.sequences[0], Poisoned), "a request failed that had no fault"
            assert all(not seq.blocks.table for seq in request.sequences), "a failed request holds blocks"

    def check_work(self, work: Work, running: set[int]) -> None:
        seq = work.seq
        assert id(seq) in running and not seq.finished and not seq.awaits_prompt, (
            "planned a sequence not running"
        )
        assert work.count >= 1 and seq.computed + work.count <= len(seq.tokens), (
            "planned past the known tokens"
        )
        covered = len(seq.blocks.table) * self.block_size
        assert covered >= seq.computed + work.count + len(work.proposals), "the blocks do not cover the work"
        end = seq.computed + work.count
        assert not any(image.start < end < image.end for image in seq.images), "a chunk ended inside an image"
        if work.proposals:
            assert work.count == 1 and seq.pending == 1, "proposals on a row that does not decode"
            assert len(seq.tokens) + len(work.proposals) <= seq.max_length, "proposals past the row's length"

    def check_never_held_back(self, plan: StepPlan[Request]) -> None:
        """A running sequence with one token left (it decodes) is planned in every step."""
        planned = {id(w.seq) for w in plan.work}
        for request in self.scheduler.running:
            if not request.needs_kv:
                continue
            for seq in request.sequences:
                if seq.finished or seq.awaits_prompt:
                    continue
                assert seq.pending >= 1, "a running sequence has nothing to compute"
                assert seq.pending > 1 or id(seq) in planned, "a decoding sequence was held back"

    def check_head_admitted(self, plan: StepPlan[Request]) -> None:
        """When no prompt chunk took the budget, the head of the queue was admitted if slots and free
        blocks cover it: its live sequences fit ``max_running`` and all its known tokens fit the
        available blocks (then its first chunk does, whatever the cache supplies)."""
        scheduler = self.scheduler
        if not scheduler.waiting or any(w.seq.pending > 1 for w in plan.work):
            return
        head = scheduler.waiting[
            scheduler.policy.next_index(scheduler.waiting, scheduler.running, scheduler.room)
        ]
        live = [seq for seq in head.sequences if not seq.finished]
        if len(live) + scheduler.running_sequences > scheduler.max_running:
            return
        blocks = scheduler.blocks
        need = (
            sum(blocks.blocks_for(len(s.tokens)) for s in live if not s.awaits_prompt) if head.needs_kv else 0
        )
        assert need > blocks.available, "the head of the queue waits though slots and free blocks cover it"

    def check_priority(self, plan: StepPlan[Request]) -> None:
        """When no prompt chunk took the budget, the policy's next request has no running request of
        a lower priority left that it could have preempted (under ``fair``: of its own tenant)."""
        scheduler, policy = self.scheduler, self.scheduler.policy
        if not isinstance(policy, PriorityPolicy) or not scheduler.waiting:
            return
        if any(w.seq.pending > 1 for w in plan.work):
            return
        head = scheduler.waiting[policy.next_index(scheduler.waiting, scheduler.running, scheduler.room)]
        if head in plan.preempted:
            return  # it yielded in this plan (to a claim of fairness): it is not started again at once
        rivals = scheduler.running
        if isinstance(policy, FairPolicy):
            rivals = [r for r in rivals if r.scheduling.tenant == head.scheduling.tenant]
        lowest = max((r.scheduling.priority for r in rivals), default=head.scheduling.priority)
        assert lowest <= head.scheduling.priority, "a waiting request outranks a running one it could preempt"

    def check_speculation(self, plan: StepPlan[Request]) -> None:
        """Proposals take only what the chunks left of the budget, and only in small batches."""
        scheduler = self.scheduler
        verifying = [w for w in plan.work if w.proposals]
        if not verifying:
            return
        rows = sum(1 for w in plan.work if w.count == 1)
        assert scheduler.speculate_max_rows is None or rows <= scheduler.speculate_max_rows, (
            "proposals in a large batch"
        )
        chunks = sum(w.count for w in plan.work if w.seq.pending > 1)
        spent = chunks + sum(1 + len(w.proposals) for w in verifying)
        assert spent <= scheduler.prefill_budget_tokens, "proposals went past the step's budget"

    def check_cached_tokens(self, plan: StepPlan[Request]) -> None:
        """A first admission reports as cached the prompt tokens it reused (what it attached)."""
        for request in plan.started:
            if request.needs_kv and request.request_id not in self.admitted:
                seq = request.sequences[0]
                assert seq.cached_tokens == min(seq.computed, seq.prompt_length), (
                    "cached tokens differ from reused"
                )

    def check_state(self) -> None:
        """After the step: the ledger of requests, the block accounting and the shadowed KV."""
        scheduler, blocks = self.scheduler, self.scheduler.blocks
        waiting = [r.request_id for r in scheduler.waiting]
        running = [r.request_id for r in scheduler.running]
        places = set(waiting) | set(running)
        assert len(places) == len(waiting) + len(running), "a request is in two places"
        assert not places & (self.ended | self.failed), "an ended or failed request is still scheduled"
        assert places | self.ended | self.failed == set(self.known), "a request was lost"
        refs = [0] * blocks.num_blocks
        for request in scheduler.running:
            for seq in request.sequences:
                assert not (seq.finished and seq.blocks.table), "a finished sequence holds blocks"
                for block in seq.blocks.table:
                    refs[block] += 1
                if not seq.finished:
                    self.check_kv(seq)
        for request in scheduler.waiting:
            assert all(not seq.blocks.table for seq in request.sequences), "a waiting request holds blocks"
        assert refs == blocks._refs, "reference counts drifted from the block tables"
        free, reusable = set(blocks._free), set(blocks._reusable)
        held = {b for b, count in enumerate(refs) if count}
        assert len(free) == len(blocks._free) and not (free & reusable) and not (held & (free | reusable))
        assert len(free) + len(reusable) + len(held) == blocks.num_blocks
        for block, entry in blocks._by_block.items():
            assert self.pool[block] == list(entry.key[1]), "a cached block holds other keys than its entry's"
        self.check_host(blocks)

    def check_host(self, blocks: BlockManager) -> None:
        """Every host-tier entry's slot holds its keys (once its queued copy ran); no slot leaks."""
        tier = blocks.tier
        if tier is None:
            return
        tables = [seq.blocks for request in self.scheduler.running for seq in request.sequences]
        assert blocks.audit(tables) is None, blocks.audit(tables)
        self.copy()  # what the next forward would run first
        for entry_id, slot in tier._lru.items():
            entry = blocks._by_id[entry_id]
            assert self.host[slot] == list(entry.key[1]), "a host slot holds other keys than its entry's"

    def check_kv(self, seq: SeqState) -> None:
        """Every computed token's slot holds that token's key (an image's key inside its span)."""
        size = self.block_size
        for place in range(seq.computed):
            slot = self.pool[seq.blocks.table[place // size]][place % size]
            assert slot == key(seq, place), "a sequence's KV is not its tokens' (a wrong prefix reused)"


def key(seq: SeqState, place: int) -> int:
    """What the KV at ``place`` is computed from: the image inside an image's span, else the token
    (worked out here, not by ``SeqState.cache_keys``, which is under test)."""
    return next((image.key for image in seq.images if image.start <= place < image.end), seq.tokens[place])


def simulate(
    seed: int,
    scheduler_class: type[Scheduler[Request]] = Scheduler,
    policy: Callable[[PolicyName, Callable[[], float]], Policy] = make_policy,
) -> Simulation:
    """``STEPS`` steps with arrivals, then steps until everything finished."""
    sim = Simulation(seed, scheduler_class, policy)
    for _ in range(STEPS):
        for _ in range(sim.rng.choice([0, 0, 1, 2])):
            sim.arrive()
        sim.control()
        sim.step()
    for _ in range(STEPS * 4):  # no more arrivals: everything finishes
        if not (sim.scheduler.waiting or sim.scheduler.running):
            break
        sim.step()
    assert not sim.scheduler.waiting and not sim.scheduler.running, "work was left"
    assert sim.scheduler.blocks.used == 0
    return sim


@pytest.mark.parametrize("seed", SEEDS)
def test_the_scheduler_passes_every_check_of_the_simulation(seed: int):
    simulate(seed)


class HoldsBackTheNewest(Scheduler[Request]):
    """Broken on purpose: never plans the newest running request while two or more run."""

    def _plan(self, item, budget, plan):  # type: ignore[no-untyped-def]
        if len(self.running) >= 2 and item is self.running[-1]:
            return budget, True
        return super()._plan(item, budget, plan)


class AdmitsNothingWhileRunning(Scheduler[Request]):
    """Broken on purpose: admits nothing while any request runs."""

    def _start(self, item, budget, plan):  # type: ignore[no-untyped-def]
        if self.running:
            return budget, False
        return super()._start(item, budget, plan)


@pytest.mark.parametrize(
    ("broken", "check"),
    [
        (HoldsBackTheNewest, "a decoding sequence was held back"),
        (AdmitsNothingWhileRunning, "the head of the queue waits"),
    ],
)
def test_the_simulation_catches_a_broken_scheduler_in_most_seeds(
    broken: type[Scheduler[Request]], check: str
):
    caught = 0
    for seed in BROKEN_SEEDS:
        try:
            simulate(seed, broken)
        except AssertionError as failure:
            caught += str(failure).startswith(check)
    assert caught > len(BROKEN_SEEDS) / 2, (
        f"{broken.__name__} got past the checks in {len(BROKEN_SEEDS) - caught} seeds"
    )


class NeverPreempts(PriorityPolicy):
    """Broken on purpose: orders by priority but never preempts for it."""

    def victim(self, head, running, room):  # type: ignore[no-untyped-def]
        return None


def test_the_simulation_catches_a_priority_policy_that_never_preempts():
    caught = 0
    seeds = [seed for seed in BROKEN_SEEDS if Features.of(seed).policy is PolicyName.PRIORITY] or [3]
    for seed in seeds:
        try:
            simulate(seed, policy=lambda name, clock: NeverPreempts(clock))
        except AssertionError as failure:
            caught += str(failure).startswith("a waiting request outranks")
    assert caught > len(seeds) / 2, f"NeverPreempts got past the checks in {len(seeds) - caught} seeds"
