from dataclasses import dataclass

import pytest

from worker.errors import QueueFull
from worker.scheduler import Scheduler


@dataclass
class Item:
    request_id: str
    num_sequences: int = 1
    prompt_length: int = 10


def test_admits_in_arrival_order_up_to_max_running():
    sched: Scheduler[Item] = Scheduler(max_running=2, max_queue=10, prefill_budget_tokens=1000)
    for name in "abc":
        sched.add(Item(name))
    plan = sched.schedule()
    assert [i.request_id for i in plan.prefill] == ["a", "b"]
    assert plan.decode == []
    plan = sched.schedule()
    assert plan.prefill == [] and [i.request_id for i in plan.decode] == ["a", "b"]
    assert [i.request_id for i in sched.waiting] == ["c"]


def test_finished_request_frees_its_slot_for_the_next_step():
    sched: Scheduler[Item] = Scheduler(max_running=1, max_queue=10, prefill_budget_tokens=1000)
    sched.add(Item("a"))
    sched.add(Item("b"))
    sched.schedule()
    assert sched.remove("a") is not None
    plan = sched.schedule()
    assert [i.request_id for i in plan.prefill] == ["b"]


def test_queue_bound_raises_queue_full_with_retry_hint():
    sched: Scheduler[Item] = Scheduler(max_running=1, max_queue=2, prefill_budget_tokens=1000)
    sched.add(Item("a"))
    sched.add(Item("b"))
    with pytest.raises(QueueFull) as info:
        sched.add(Item("c"))
    assert info.value.retry_after_seconds and "queue is full" in info.value.message


def test_prefill_budget_limits_admissions_per_step_but_never_starves_a_long_prompt():
    sched: Scheduler[Item] = Scheduler(max_running=8, max_queue=10, prefill_budget_tokens=100)
    sched.add(Item("long", prompt_length=500))
    sched.add(Item("short", prompt_length=50))
    plan = sched.schedule()
    assert [i.request_id for i in plan.prefill] == ["long"]  # alone, though over budget
    plan = sched.schedule()
    assert [i.request_id for i in plan.prefill] == ["short"]


def test_n_sequences_count_against_max_running():
    sched: Scheduler[Item] = Scheduler(max_running=4, max_queue=10, prefill_budget_tokens=1000)
    sched.add(Item("a", num_sequences=3))
    sched.add(Item("b", num_sequences=2))
    assert [i.request_id for i in sched.schedule().prefill] == ["a"]
    assert sched.running_sequences == 3


def test_remove_finds_queued_and_running_and_ignores_unknown():
    sched: Scheduler[Item] = Scheduler(max_running=1, max_queue=10, prefill_budget_tokens=1000)
    sched.add(Item("run"))
    sched.add(Item("wait"))
    sched.schedule()
    assert sched.remove("wait").request_id == "wait"
    assert sched.remove("run").request_id == "run"
    assert sched.remove("ghost") is None
    assert not sched.running and not sched.waiting
