"""Speculative decoding's engine side: which rows propose, their proposals (n-gram lookup or a draft
model), and each row's acceptance window (a row whose proposals keep failing pauses). Verification:
``worker/sampling/verify.py``, driven by ``Update``."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from worker.model.draft import DraftCache, DraftModel
from worker.sampling.ngram import propose
from worker.sampling.sampler import SequenceSampling

# A row's acceptance is judged over its latest verifying steps holding at least this many proposals;
# a row below the threshold proposes nothing for PAUSE_TOKENS generated tokens, then tries again.
WINDOW_TOKENS = 16
PAUSE_TOKENS = 64


@dataclass
class RowSpeculation:
    """One row's recent verifying steps (proposed, accepted), while paused the output length at
    which it proposes again, and its draft model's cache (``--speculative draft``)."""

    steps: deque[tuple[int, int]] = field(default_factory=deque)
    paused_until: int = 0
    draft: DraftCache = field(default_factory=DraftCache)

    @property
    def rate(self) -> float | None:
        """Accepted / proposed over the window; None until the window holds WINDOW_TOKENS."""
        proposed = sum(p for p, _ in self.steps)
        return sum(a for _, a in self.steps) / proposed if proposed >= WINDOW_TOKENS else None


@dataclass(frozen=True)
class Speculation:
    """``--speculative`` with its sizes: ``tokens`` proposals a step, from ``draft`` when given, else
    n-gram lookup of suffixes of ``min_n``..``max_n`` tokens; only in steps where at most
    ``max_rows`` sequences decode (None: any number); a row whose acceptance over its window is
    below ``min_acceptance`` pauses."""

    tokens: int
    min_n: int
    max_n: int
    max_rows: int | None = None
    min_acceptance: float = 0.0
    draft: DraftModel | None = None

    @property
    def proposer(self) -> str:
        return "ngram" if self.draft is None else "draft"

    def proposals(
        self, sampling: SequenceSampling, acceptance: RowSpeculation, tokens: Sequence[int], room: int
    ) -> list[int]:
        """What the row may verify this step: at most ``room`` tokens, cut before the first one its
        grammar forbids; none when its request turned speculation off or its acceptance paused it; few
        enough that its thinking budget is not reached inside them."""
        limit = min(self.tokens, room)
        if sampling.thinking is not None:
            limit = min(limit, sampling.thinking.allowed_prefix())
        if limit <= 0 or not sampling.options.speculative or sampling.generated < acceptance.paused_until:
            return []
        found = self.guesses(sampling, acceptance, tokens, limit)
        if found and sampling.constraint is not None:
            found = found[: sampling.constraint.allowed_prefix(found)]
        return found

    def guesses(
        self, sampling: SequenceSampling, acceptance: RowSpeculation, tokens: Sequence[int], k: int
    ) -> list[int]:
        """The proposer's up to ``k`` guesses of the tokens after ``tokens`` (the row's prompt and output)."""
        if self.draft is not None:
            return self.draft.propose(acceptance.draft, tokens, k)
        return propose(tokens, min_n=self.min_n, max_n=self.max_n, k=k)

    def observe(self, acceptance: RowSpeculation, proposed: int, accepted: int, generated: int) -> bool:
        """Records one verifying step of the row (``generated``: its output length after it); a
        full window below ``min_acceptance`` pauses the row and starts a fresh window (True)."""
        acceptance.steps.append((proposed, accepted))
        while sum(p for p, _ in acceptance.steps) - acceptance.steps[0][0] >= WINDOW_TOKENS:
            acceptance.steps.popleft()
        rate = acceptance.rate
        if rate is not None and rate < self.min_acceptance:
            acceptance.steps.clear()
            acceptance.paused_until = generated + PAUSE_TOKENS
            return True
        return False
