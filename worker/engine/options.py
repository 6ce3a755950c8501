"""The engine's settings: its limits (rows, queue, a step's prompt tokens), the prefix cache, the
text rules of its streams, how its steps and outputs are paced, and its scheduling policy.

Design notes: docs/worker.md ("`worker/engine/core.py`").
"""

from __future__ import annotations

from dataclasses import dataclass

from worker.engine.policy import Policy, PolicyName, make_policy


@dataclass(frozen=True)
class EngineOptions:
    """``stream_interval``: a stream's tokens are handed over every that many steps (its first token
    and its end at once), which cuts the per-message work of many concurrent streams; ``overlap``: a
    step's draw is read while the next step's forward runs (docs/worker.md, "Steps that overlap")."""

    max_running: int = 16
    max_queue: int = 256
    prefill_budget_tokens: int = 1024
    prefix_caching: bool = True
    blocked_phrases: tuple[str, ...] = ()
    refusal_message: str = "I can't help with that."
    stream_interval: int = 1
    overlap: bool = False
    scheduling_policy: str = "fcfs"  # --scheduling-policy (worker/engine/policy.py)

    def __post_init__(self) -> None:
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be at least 1, got {self.stream_interval}")
        if self.scheduling_policy not in tuple(PolicyName):
            raise ValueError(f"scheduling_policy must be one of {', '.join(PolicyName)}")

    def policy(self) -> Policy:
        """A new scheduler's policy (each scheduler owns one: it keeps counters)."""
        return make_policy(self.scheduling_policy)
