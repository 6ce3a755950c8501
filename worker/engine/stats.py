"""The engine's counters, the stats snapshot that metrics and tests read (:meth:`Engine.stats`), and
the copy of it the engine publishes for readers that must never wait for a step (``/metrics``).

Design notes: docs/worker.md (``worker/metrics.py``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from sluice.prometheus import Histogram
from worker.engine.class_stats import ClassStats
from worker.engine.host_tier import TierStats
from worker.engine.scheduler import Scheduler
from worker.types import FastPath

log = logging.getLogger(__name__)

# While the engine steps, its published stats are at most this old (it also publishes them before it
# hands out a request's end, and whenever it runs out of work).
STATS_INTERVAL_S = 0.1


@dataclass
class EngineCounters:
    """Monotonic counters, read by metrics and by tests through the metrics endpoint."""

    requests_submitted: int = 0
    requests_finished: int = 0
    requests_cancelled: int = 0
    requests_failed: int = 0
    generated_tokens: int = 0
    prompt_tokens: int = 0
    prefix_cache_hit_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    preemptions: int = 0  # requests sent back to the queue (recomputed later): blocks, or the policy
    steps: int = 0
    decode_only_steps: int = 0  # steps whose every row decodes one token (CUDA: replayed from a graph)
    speculative_proposed_tokens: int = 0  # proposals verified (--speculative)
    speculative_accepted_tokens: int = 0  # of them, those equal to the row's own draw
    speculative_paused_rows: int = 0  # times a row stopped proposing for low acceptance
    speculative_proposal_failures: int = 0  # rows whose proposer raised (no proposals that step)
    step_failures: int = 0  # steps (or plans) whose failure failed the requests they touched
    time_to_first_token: Histogram = field(default_factory=Histogram)


@dataclass(frozen=True)
class EngineStats:
    waiting_requests: int
    running_requests: int
    running_sequences: int
    live_caches: int
    cache_tokens: int
    cache_bytes: int
    reserved_tokens: int
    counters: EngineCounters
    # The KV cache as blocks (what an inference gateway's endpoint picker scores): the pool's block
    # size in tokens, its block count, and the blocks held now (by running sequences or kept for reuse).
    kv_block_size: int = 1
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    fast_path: FastPath | None = None  # CUDA only: which parts of the decode fast path are on
    graph_replays: int = 0  # decode steps replayed from a CUDA graph
    graph_lora_replays: int = 0  # of which with LoRA adapter rows (their slots graph inputs)
    mixers_on_kernels: bool | None = None  # a hybrid's mixers on their kernels (None: no mixers)
    speculative_proposer: str | None = None  # --speculative's proposer; None: off
    state_cache_bytes: int = 0  # a hybrid model's state pool (worker/attention/state_pool.py)
    # --enable-lora: the most adapters a step holds (0: off), and the adapters of the running and
    # of the waiting requests, by name (vLLM's lora_requests_info).
    max_loras: int = 0
    running_loras: tuple[str, ...] = ()
    waiting_loras: tuple[str, ...] = ()
    classes: ClassStats = field(default_factory=ClassStats)  # by priority and tenant (the policy's)
    host_tier: TierStats | None = None  # --kv-offload-bytes (None: off)

    @classmethod
    def of(
        cls, scheduler: Scheduler[Any], runner: Any, proposer: str | None, counters: EngineCounters
    ) -> EngineStats:
        """A snapshot of an engine's scheduler, runner and counters (under the engine's lock)."""
        running = list(scheduler.running)
        sequences = [seq for r in running for seq in r.sequences if not seq.finished]
        blocks = scheduler.blocks
        return cls(
            waiting_requests=len(scheduler.waiting),
            running_requests=len(running),
            running_sequences=len(sequences),
            live_caches=sum(1 for seq in sequences if seq.blocks.table),
            cache_tokens=sum(seq.computed for seq in sequences),
            cache_bytes=runner.pool_bytes,
            reserved_tokens=blocks.used * blocks.block_size,
            kv_block_size=blocks.block_size,
            kv_blocks_total=blocks.num_blocks,
            kv_blocks_used=blocks.used,
            fast_path=getattr(runner, "fast_path", None),
            graph_replays=getattr(getattr(runner, "graphs", None), "replays", 0),
            graph_lora_replays=getattr(getattr(runner, "graphs", None), "adapter_replays", 0),
            mixers_on_kernels=getattr(runner, "mixers_on_kernels", None),
            speculative_proposer=proposer,
            state_cache_bytes=getattr(runner, "state_bytes", 0),
            max_loras=getattr(getattr(runner, "lora", None), "max_loras", 0),
            running_loras=_adapters(running),
            waiting_loras=_adapters(scheduler.waiting),
            counters=replace(counters, time_to_first_token=counters.time_to_first_token.copy()),
            classes=scheduler.policy.stats.copy(),
            host_tier=blocks.tier.stats() if blocks.tier is not None else None,
        )

    @property
    def kv_cache_usage(self) -> float:
        """The fraction of the KV cache's blocks in use, 0..1 (0 when it has none)."""
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


def _adapters(requests: Any) -> tuple[str, ...]:
    """The names of the LoRA adapters ``requests`` use, sorted, each once."""
    return tuple(sorted({seq.lora.name for r in requests for seq in r.sequences[:1] if seq.lora is not None}))


class PublishedStats:
    """The last stats snapshot an engine published, read without the engine's lock: a ``/metrics``
    scrape never waits for a step. Only the engine's own thread refreshes it; listeners hear of each
    new copy there, so they must be quick (the engine process hands it to a sending thread)."""

    def __init__(self, snapshot: Callable[[], EngineStats], interval_s: float = STATS_INTERVAL_S):
        """``snapshot``: the engine's exact stats (taken once now, then at each refresh)."""
        self._snapshot = snapshot
        self.interval_s = interval_s
        self._listeners: list[Callable[[EngineStats], None]] = []
        self._taken = time.monotonic()
        self.latest = snapshot()

    def listen(self, listener: Callable[[EngineStats], None]) -> None:
        """Calls ``listener(copy)`` with each later copy, on the engine's thread."""
        self._listeners.append(listener)

    def refresh(self) -> None:
        """Takes a new copy (on the engine's thread)."""
        self.latest, self._taken = self._snapshot(), time.monotonic()
        for listener in self._listeners:
            try:
                listener(self.latest)
            except Exception:  # a listener's bug must not stop the engine's loop
                log.exception("a stats listener failed")

    def refresh_if_due(self) -> None:
        """Takes a new copy if the last one is ``interval_s`` old."""
        if time.monotonic() - self._taken >= self.interval_s:
            self.refresh()
