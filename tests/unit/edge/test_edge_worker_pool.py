"""Worker choice: least outstanding, ties round-robin, recently-down workers last."""

from __future__ import annotations

import time

from edge.worker_pool import WorkerPool


def pool() -> WorkerPool:
    return WorkerPool(["a:1", "b:2", "c:3"], connect_timeout_s=1.0, health_timeout_s=1.0)


def test_ties_rotate_round_robin() -> None:
    p = pool()
    firsts = [p._candidates()[0].address for _ in range(6)]
    assert firsts == ["a:1", "b:2", "c:3", "a:1", "b:2", "c:3"]


def test_least_outstanding_wins() -> None:
    p = pool()
    a, b, c = p._workers
    a.outstanding, b.outstanding, c.outstanding = 2, 0, 1
    assert [w.address for w in p._candidates()] == ["b:2", "c:3", "a:1"]


def test_recently_down_workers_go_last_but_stay_candidates() -> None:
    p = pool()
    a, _, _ = p._workers
    a.down_until = time.monotonic() + 60
    order = [w.address for w in p._candidates()]
    assert order[-1] == "a:1" and len(order) == 3
