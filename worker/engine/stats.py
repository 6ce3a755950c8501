"""The engine's counters and the stats snapshot that metrics and tests read (:meth:`Engine.stats`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from sluice.prometheus import Histogram
from worker.types import FastPath


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
    preemptions: int = 0  # requests sent back to the queue for blocks (recomputed later)
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
    speculative_proposer: str | None = None  # --speculative's proposer; None: off

    @property
    def kv_cache_usage(self) -> float:
        """The fraction of the KV cache's blocks in use, 0..1 (0 when it has none)."""
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0
