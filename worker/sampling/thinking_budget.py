"""A choice's thinking budget at the token level: counts the tokens written inside the family's thinking
block and, once the budget is spent, forces the block's end token by token (as a forced tool call's
markers are forced) so that the answer follows. Design notes: docs/worker.md, "Thinking budgets"."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from worker.types import ThinkingBudget

Decode = Callable[[Sequence[int]], str]


class BudgetedThinking:
    """One choice's state: before the block, inside it (counting), forcing its end, or after it.

    The markers are found in the decoded text of the last few tokens, so a marker the model writes as
    several ordinary tokens (Granite's ``<think>``) is found however its text was split; the block
    may open again later (gpt-oss's next analysis message), and its tokens count on."""

    def __init__(self, budget: ThinkingBudget, decode: Decode):
        self._budget = budget
        self._decode = decode
        self._thinking = budget.starts_thinking
        self.spent = 0  # tokens written inside the block
        self._forcing: list[int] = []
        self._tail: list[int] = []
        # A marker of n characters is at most n tokens; two more for its neighbours.
        self._window = max(len(budget.open_text), len(budget.close_text)) + 2
        self._check_spent()

    @property
    def thinking(self) -> bool:
        """Inside the block (forcing its end included)."""
        return self._thinking

    def forced(self) -> int | None:
        """The token the next draw must be (the block's end being forced), or None."""
        return self._forcing[0] if self._forcing else None

    def record(self, token_id: int) -> None:
        """Follows one generated token (a forced one included)."""
        if self._forcing:
            self._forcing.pop(0)
            if not self._forcing:
                self._thinking, self._tail = False, []
            return
        self._tail = [*self._tail[1 - self._window :], token_id]
        if not self._thinking:
            if self._seen(self._budget.open_text):
                self._thinking, self._tail = True, []
                self._check_spent()
            return
        self.spent += 1
        if self._seen(self._budget.close_text):
            self._thinking, self._tail = False, []
        else:
            self._check_spent()

    def allowed_prefix(self) -> int:
        """How many speculative proposals may be verified at once: few enough that none of the
        positions they cover could reach the budget (a forced token is never verified)."""
        if self._forcing:
            return 0
        return max(0, self._budget.tokens - self.spent - 1)

    def _seen(self, marker: str) -> bool:
        """The marker ends in the last few tokens (the tail is decoded only when the last token's
        text holds the marker's last character: a few tokens of a step's whole vocabulary do)."""
        return (
            bool(marker)
            and marker[-1] in self._decode(self._tail[-1:])
            and marker in self._decode(self._tail)
        )

    def _check_spent(self) -> None:
        if self._thinking and self.spent >= self._budget.tokens:
            self._forcing = list(self._budget.close_ids)
            if not self._forcing:  # a block without an end to force: nothing more to do
                self._thinking = False
