"""The scheduling policies with the scheduler, no model: priority order and preemption, earliest
deadline first, refusal at admission, and tenants' fair shares (worker/engine/policy.py)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from worker.engine.kv_blocks import BlockManager
from worker.engine.policy import INPUT_WEIGHT, OUTPUT_WEIGHT, FairPolicy, make_policy
from worker.engine.scheduler import Scheduler, SeqState
from worker.errors import DeadlineUnreachable
from worker.types import Scheduling


@dataclass(eq=False)
class Item:
    request_id: str
    sequences: list[SeqState] = field(default_factory=list)
    needs_kv: bool = True
    scheduling: Scheduling = field(default_factory=Scheduling)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def item(name: str, prompt: int = 5, *, max_tokens: int = 8, **scheduling) -> Item:
    tokens = [hash((name, i)) % 1000 for i in range(prompt)]
    return Item(
        name, [SeqState(list(tokens), prompt, prompt + max_tokens)], scheduling=Scheduling(**scheduling)
    )


def scheduler(policy: str, clock: Clock | None = None, blocks: int = 256, **options) -> Scheduler[Item]:
    settings = {"max_running": 2, "max_queue": 64, "prefill_budget_tokens": 100, **options}
    return Scheduler(BlockManager(blocks, 4), policy=make_policy(policy, clock or Clock()), **settings)


def run_step(s: Scheduler[Item]):
    """A step as the engine runs it: commit, a token for each row that samples, and the end of every
    request whose sequences reached their length."""
    plan = s.schedule()
    for work in plan.work:
        s.committed(work)
        if work.sample:
            work.seq.tokens.append(7)
    for request in list(s.running):
        for seq in request.sequences:
            if not seq.finished and len(seq.tokens) >= seq.max_length:
                s.finish(seq)
        if all(seq.finished for seq in request.sequences):
            s.remove(request.request_id)
    return plan


def names(items) -> list[str]:
    return [i.request_id for i in items]


def test_waiting_requests_start_in_priority_order_and_ties_in_arrival_order():
    s = scheduler("priority", max_running=1)
    for name, priority in [("a", 3), ("b", 1), ("c", 3), ("d", 1), ("e", -2)]:
        s.add(item(name, priority=priority))
    started = []
    for _ in range(60):
        started += names(run_step(s).started)
    assert started == ["e", "b", "d", "a", "c"]


def test_fcfs_keeps_arrival_order_whatever_the_priority():
    s = scheduler("fcfs", max_running=1)
    for name, priority in [("a", 3), ("b", 1), ("c", -5)]:
        s.add(item(name, priority=priority))
    started = []
    for _ in range(40):
        started += names(run_step(s).started)
    assert started == ["a", "b", "c"]


def test_a_higher_priority_request_preempts_the_lowest_running_one_when_no_slot_is_free():
    s = scheduler("priority", max_running=2)
    s.add(item("low-old", priority=5))
    s.add(item("low-new", priority=5))
    run_step(s)
    run_step(s)  # the two low ones decode
    s.add(item("mid", priority=3))
    s.add(item("urgent", priority=0))
    plan = run_step(s)
    # both outrank the low ones: both preempted, the newest low one first
    assert names(plan.preempted) == ["low-new", "low-old"]
    assert names(plan.started) == ["urgent", "mid"]
    assert s.policy.stats.preemptions == {"priority": 2}
    assert all(not seq.blocks.table for r in s.waiting for seq in r.sequences)
    assert not any(w.seq in s.waiting[0].sequences for w in plan.work), "a preempted request's work stayed"


def test_a_higher_priority_request_short_of_blocks_preempts_a_lower_one_for_them():
    s = scheduler("priority", blocks=6, max_running=4)
    s.add(item("low", prompt=17, priority=5, max_tokens=4))  # 5 of the 6 blocks once it decodes
    run_step(s)
    s.add(item("high", prompt=6, priority=0, max_tokens=2))  # 2 blocks: 1 is free
    plan = run_step(s)
    assert names(plan.preempted) == ["low"] and names(plan.started) == ["high"]
    assert s.policy.stats.preemptions == {"priority": 1}
    s_fcfs = scheduler("fcfs", blocks=6, max_running=4)
    s_fcfs.add(item("low", prompt=17, priority=5, max_tokens=4))
    run_step(s_fcfs)
    s_fcfs.add(item("high", prompt=6, priority=0, max_tokens=2))
    plan = run_step(s_fcfs)
    assert not plan.preempted and not plan.started  # first come, first served: it waits


def test_equal_priorities_never_preempt_each_other():
    s = scheduler("priority", max_running=1)
    s.add(item("a", priority=1))
    run_step(s)
    s.add(item("b", priority=1))
    plan = run_step(s)
    assert not plan.preempted and not plan.started and names(s.running) == ["a"]


def test_a_preempted_request_recomputes_its_prompt_and_tokens_later():
    s = scheduler("priority", max_running=1)
    low = item("low", priority=2, max_tokens=4)
    s.add(low)
    for _ in range(3):
        run_step(s)
    generated = low.sequences[0].generated
    s.add(item("high", priority=0, max_tokens=2))
    plan = run_step(s)
    assert names(plan.preempted) == ["low"] and names(plan.started) == ["high"]
    while s.running or s.waiting:
        plan = run_step(s)
        if low in plan.started:
            # prompt and generated tokens computed again (past what the prefix cache kept), as one chunk
            (work,) = [w for w in plan.work if w.seq is low.sequences[0]]
            assert work.start + work.count == 5 + generated
    assert low.sequences[0].finished and low.sequences[0].generated == 4


def test_equal_priorities_start_earliest_deadline_first_and_no_deadline_last():
    s = scheduler("priority", max_running=1)
    s.add(item("none"))
    s.add(item("late", deadline=500.0))
    s.add(item("soon", deadline=100.0))
    s.add(item("urgent-late", deadline=900.0, priority=-1))
    started = []
    for _ in range(60):
        started += names(run_step(s).started)
    assert started == ["urgent-late", "soon", "late", "none"]


def test_a_request_that_cannot_finish_by_its_deadline_is_refused_at_admission_and_counted():
    clock = Clock()
    s = scheduler("priority", clock, max_running=1, prefill_budget_tokens=10)
    s.add(item("running", prompt=40))
    run_step(s)  # no step measured yet: nothing is refused
    clock.now += 0.5  # a step takes half a second
    run_step(s)
    assert s.policy.step_s == pytest.approx(0.5)
    # 20 tokens of "running"'s prompt are left, then its own 10: three steps of 10 tokens, 1.5 s
    with pytest.raises(DeadlineUnreachable) as refused:
        s.add(item("hopeless", prompt=10, deadline=clock.now + 1.4))
    assert refused.value.code.name == "DEADLINE_EXCEEDED"
    assert s.policy.stats.deadline_refusals == 1
    assert names(s.waiting) == []
    s.add(item("possible", prompt=10, deadline=clock.now + 1.6))
    s.add(item("no-deadline", prompt=500))
    assert names(s.waiting) == ["possible", "no-deadline"]


def test_fcfs_never_refuses_for_deadlines():
    clock = Clock()
    s = scheduler("fcfs", clock)
    s.add(item("a", prompt=40))
    run_step(s)
    clock.now += 10.0
    run_step(s)
    s.add(item("late", deadline=clock.now + 0.001))
    assert names(s.waiting) == ["late"]


def test_queue_wait_is_observed_per_priority_and_tenant_at_the_first_start():
    clock = Clock()
    s = scheduler("priority", clock, max_running=1)
    s.add(item("a", priority=1, tenant="team-a"))
    s.add(item("b", priority=2, tenant="team-b"))
    run_step(s)
    clock.now = 3.0
    while s.waiting or s.running:
        run_step(s)
    waits = s.policy.stats.queue_wait
    assert waits[("1", "team-a")].count == 1 and waits[("1", "team-a")].total == 0.0
    assert waits[("2", "team-b")].count == 1 and waits[("2", "team-b")].total == 3.0


def test_under_fair_a_tenant_with_one_request_starts_at_once_behind_another_tenants_flood():
    s = scheduler("fair", max_running=4)
    for i in range(12):
        s.add(item(f"flood{i}", tenant="b", max_tokens=50))
    for _ in range(5):
        run_step(s)
    assert len(s.running) == 4
    s.add(item("single", tenant="a", max_tokens=3))
    plan = run_step(s)
    assert names(plan.started) == ["single"]
    # the flood's most-served request yields (among equals, the latest)
    assert names(plan.preempted) == ["flood3"]
    assert s.policy.stats.preemptions == {"fairness": 1}


def test_under_fair_a_tenant_gets_up_to_an_equal_share_of_the_slots_at_once():
    s = scheduler("fair", max_running=4)
    for i in range(12):
        s.add(item(f"flood{i}", tenant="b", max_tokens=50))
    for _ in range(3):
        run_step(s)
    for i in range(4):
        s.add(item(f"short{i}", tenant="a", max_tokens=3))
    plan = run_step(s)
    assert names(plan.started) == ["short0", "short1"]  # two of four slots: an equal share
    assert sorted(r.scheduling.tenant for r in s.running) == ["a", "a", "b", "b"]


def test_within_a_tenant_fair_orders_by_priority_and_preempts_its_own_lower_priority():
    s = scheduler("fair", max_running=2)
    s.add(item("a-low", tenant="a", priority=5))
    s.add(item("a-low2", tenant="a", priority=5))
    run_step(s)
    s.add(item("a-high", tenant="a", priority=0))
    plan = run_step(s)
    assert names(plan.started) == ["a-high"] and names(plan.preempted) == ["a-low2"]
    assert s.policy.stats.preemptions == {"priority": 1}


def test_a_tenants_priority_does_not_preempt_another_tenant_at_its_share():
    s = scheduler("fair", max_running=2)
    s.add(item("a", tenant="a", priority=5))
    s.add(item("b", tenant="b", priority=5))
    run_step(s)
    s.add(item("b-high", tenant="b", priority=-10))
    plan = run_step(s)
    # b may preempt only its own lower priority request, not a's
    assert names(plan.preempted) == ["b"] and names(plan.started) == ["b-high"]


@pytest.mark.parametrize("seed", range(3))
def test_fair_shares_of_backlogged_tenants_converge_within_a_bound_over_random_arrivals(seed: int):
    """Three tenants stay backlogged with requests of their own random shapes (one sends long
    prompts, one long outputs, one small ones); the weighted tokens each was served stay within a
    bound of each other at every step while the totals grow far past it."""
    rng = random.Random(seed)
    budget, max_running = 64, 6
    s = scheduler("fair", max_running=max_running, prefill_budget_tokens=budget)
    shapes = {"prompts": ((40, 120), (2, 8)), "outputs": ((2, 10), (30, 80)), "small": ((2, 10), (2, 10))}
    served = dict.fromkeys(shapes, 0.0)
    owner: dict[int, str] = {}
    ids = iter(range(10**6))
    widest = 0.0
    for step in range(1500):
        for tenant, (prompts, outputs) in shapes.items():
            backlog = sum(1 for r in s.waiting if r.scheduling.tenant == tenant)
            for _ in range(rng.randint(0, 2) if backlog < 3 else 0):
                request = item(
                    f"{tenant}{next(ids)}",
                    rng.randint(*prompts),
                    max_tokens=rng.randint(*outputs),
                    tenant=tenant,
                )
                s.add(request)
                owner[id(request.sequences[0])] = tenant
        plan = run_step(s)
        for work in plan.work:
            prompt = max(0, min(work.start + work.count, work.seq.prompt_length) - work.start)
            served[owner[id(work.seq)]] += INPUT_WEIGHT * prompt + OUTPUT_WEIGHT * (work.count - prompt)
        if step >= 100:
            widest = max(widest, max(served.values()) - min(served.values()))
    # Bound: what a tenant may be ahead and still claim a slot (a step's budget), plus the largest
    # request's whole cost (a request started is served to its end unless preempted).
    bound = budget + INPUT_WEIGHT * 120 + OUTPUT_WEIGHT * 80
    assert widest <= bound, (widest, served)
    assert min(served.values()) > 20 * bound
    assert isinstance(s.policy, FairPolicy)
