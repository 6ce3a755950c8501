"""The scheduler and block manager under a simulated engine (no model): random arrivals, ``n`` of 1-3,
stops (also while preempted), cancellations, shared prefixes and a tiny pool, checked on every step:
work that waits is always planned, reference counts match the block tables, and free plus reusable
plus held blocks add up to the pool. ``SLUICE_FUZZ_SCALE`` multiplies the seeds (``make fuzz``)."""

from __future__ import annotations

import contextlib
import os
import random
from dataclasses import dataclass, field

import pytest

from worker.engine.kv_blocks import BlockManager
from worker.engine.scheduler import Scheduler, Sequence, StepPlan
from worker.errors import InvalidRequest, QueueFull

SEEDS = range(int(20 * float(os.environ.get("SLUICE_FUZZ_SCALE", "1"))))
STEPS = 400


@dataclass(eq=False)
class Request:
    request_id: str
    sequences: list[Sequence] = field(default_factory=list)
    needs_kv: bool = True


class Simulation:
    """What the engine does around the scheduler, with random tokens instead of a model."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        block_size = self.rng.choice([2, 4, 8])
        self.scheduler: Scheduler[Request] = Scheduler(
            BlockManager(self.rng.randint(6, 24), block_size, prefix_caching=self.rng.random() < 0.8),
            max_running=self.rng.randint(2, 8),
            max_queue=self.rng.randint(4, 16),
            prefill_budget_tokens=self.rng.choice([1, 3, block_size, 16, 64]),
        )
        self.prefixes = [[self.rng.randrange(50) for _ in range(12)] for _ in range(3)]
        self.ids = 0
        self.stopped_while_waiting = 0

    def arrive(self) -> None:
        n = self.rng.randint(1, 3)
        prompt = self.rng.choice(self.prefixes)[: self.rng.randint(1, 12)]
        prompt = prompt + [self.rng.randrange(50) for _ in range(self.rng.randint(0, 10))] or [1]
        longest = len(prompt) + self.rng.randint(1, 12)
        self.ids += 1
        request = Request(
            f"r{self.ids}",
            [Sequence(list(prompt), len(prompt), longest, awaits_prompt=i > 0) for i in range(n)],
            needs_kv=self.rng.random() < 0.97,
        )
        with contextlib.suppress(InvalidRequest, QueueFull):
            self.scheduler.add(request)

    def control(self) -> None:
        """Cancellations and stops, applied before planning as the engine does."""
        everyone = [*self.scheduler.running, *self.scheduler.waiting]
        for request in everyone:
            roll = self.rng.random()
            if roll < 0.01:
                self.scheduler.remove(request.request_id)
            elif roll < 0.04:
                live = [seq for seq in request.sequences if not seq.finished and seq.generated]
                if live:
                    self.scheduler.finish(self.rng.choice(live))
                    self.stopped_while_waiting += request in self.scheduler.waiting
                    self.end_if_done(request)

    def end_if_done(self, request: Request) -> None:
        if all(seq.finished for seq in request.sequences):
            assert self.scheduler.remove(request.request_id) is request

    def step(self) -> StepPlan[Request]:
        plan = self.scheduler.schedule()
        for request in plan.admitted:
            if not request.needs_kv:  # a scoring-only request ends at admission
                for seq in request.sequences:
                    self.scheduler.finish(seq)
        sampled = [w.seq for w in plan.work if w.samples]
        for work in plan.work:
            self.scheduler.committed(work)
        owners = {id(seq): r for r in self.scheduler.running for seq in r.sequences}
        for seq in sampled:
            token = self.rng.randrange(50)
            firsts = [seq]
            if seq.generated == 0:  # the prompt is done: waiting siblings draw from it too
                siblings = [s for s in owners[id(seq)].sequences if s.awaits_prompt]
                for sibling in siblings:
                    sibling.awaits_prompt = False
                firsts += siblings
            for each in firsts:
                each.tokens.append(token)
                if len(each.tokens) >= each.max_length or self.rng.random() < 0.03:
                    self.scheduler.finish(each)
        for request in {id(r): r for r in [*plan.admitted, *(owners[id(s)] for s in sampled)]}.values():
            if request in self.scheduler.running:
                self.end_if_done(request)
        return plan

    def check(self, plan: StepPlan[Request]) -> None:
        scheduler, blocks = self.scheduler, self.scheduler.blocks
        if scheduler.waiting or scheduler.running:
            assert plan.work or plan.admitted, "work is waiting but the step planned nothing"
        refs = [0] * blocks.num_blocks
        for request in scheduler.running:
            for seq in request.sequences:
                assert not (seq.finished and seq.blocks.table), "a finished sequence holds blocks"
                for block in seq.blocks.table:
                    refs[block] += 1
        for request in scheduler.waiting:
            assert all(not seq.blocks.table for seq in request.sequences), "a waiting request holds blocks"
        assert refs == blocks._refs, "reference counts drifted from the block tables"
        free, reusable = set(blocks._free), set(blocks._reusable)
        held = {b for b, count in enumerate(refs) if count}
        assert len(free) == len(blocks._free) and not (free & reusable) and not (held & (free | reusable))
        assert len(free) + len(reusable) + len(held) == blocks.num_blocks


@pytest.mark.parametrize("seed", SEEDS)
def test_the_scheduler_always_makes_progress_and_never_leaks_blocks(seed: int):
    sim = Simulation(seed)
    for _ in range(STEPS):
        for _ in range(sim.rng.choice([0, 0, 1, 2])):
            sim.arrive()
        sim.control()
        sim.check(sim.step())
    for _ in range(STEPS * 4):  # no more arrivals: everything finishes
        if not (sim.scheduler.waiting or sim.scheduler.running):
            break
        sim.check(sim.step())
    assert not sim.scheduler.waiting and not sim.scheduler.running
    assert sim.scheduler.blocks.used == 0
