"""Which operation breaks batch invariance: every module's output rows for one sequence, recorded
in two runs of a runner (alone, crowded), compared position by position, so a failing test names
the first module whose output differs (``position 84: model.layers.1.mlp.experts differs by ...``)
rather than only the logits, which bfloat16 rounding makes differ seldom and late."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from worker.model.runner import ModelRunner
from worker.model.step_inputs import Work


@dataclass(frozen=True)
class Difference:
    position: int  # the sequence's position (0 = its first prompt token)
    # The first module whose output row differs (``NAME (its input)``: what ran before it, as the
    # attention function before ``o_proj``), in the order the hooks fire.
    module: str
    amount: float  # the largest absolute difference in that row

    def __str__(self) -> str:
        return f"position {self.position}: {self.module} differs by {self.amount:g}"


def _rows(value: Any, tokens: int) -> list[torch.Tensor]:
    """The tensors of a module's output laid out by the step's tokens ([1, T, ...] or [T, ...])."""
    items = value if isinstance(value, (tuple, list)) else (value,)
    rows = []
    for item in items:
        if not isinstance(item, torch.Tensor) or item.dim() == 0:
            continue
        if item.dim() >= 2 and item.shape[0] == 1 and item.shape[1] == tokens:
            rows.append(item[0])
        elif item.shape[0] == tokens:
            rows.append(item)
    return rows


class RowProbe:
    """Hooks on every module of ``runner``'s model (its input and its output); within
    :meth:`recording`, each step's rows of the tracked sequence (the items whose block table
    starts with ``table[0]``) are kept per position and module. A module called more than once in
    a forward (an activation shared by experts) is left out: its rows are not one token's."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.runs: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
        self.order: dict[str, None] = {}  # hook names, in the order they first fired
        self._run: str | None = None
        self._positions: dict[int, int] = {}  # flat token index -> the sequence's position
        self._tokens = 0
        self._step: dict[str, list[torch.Tensor]] = {}
        self._calls: Counter[str] = Counter()
        self._handles = []
        for name, module in runner.model.named_modules():
            if name:  # a module's input too: o_proj's is the attention function's output
                self._handles.append(module.register_forward_pre_hook(self._hook(f"{name} (its input)")))
                self._handles.append(module.register_forward_hook(self._hook(name)))

    def _hook(self, name: str) -> Any:
        def record(module: torch.nn.Module, args: Any, *output: Any) -> None:
            if self._run is None:
                return
            self._calls[name] += 1
            rows = _rows(output[0] if output else args, self._tokens)
            if rows:
                self.order.setdefault(name)
                self._step[name] = [r.detach().float().clone() for r in rows]

        return record

    def _execute(
        self, table_start: int, work: Sequence[Work], fed: torch.Tensor | None = None
    ) -> torch.Tensor:
        assert self._run is not None
        self._positions, first = {}, 0
        for item in work:
            if item.table[0] == table_start:
                self._positions.update({first + j: item.start + j for j in range(len(item.tokens))})
            first += len(item.tokens)
        self._tokens, self._step, self._calls = first, {}, Counter()
        out = ModelRunner.execute(self.runner, work, fed)
        run = self.runs.setdefault(self._run, {})
        for name, rows in self._step.items():
            if self._calls[name] != 1:
                continue
            for index, position in self._positions.items():
                run.setdefault(position, {})[name] = torch.cat([r[index].reshape(-1) for r in rows])
        return out

    @contextlib.contextmanager
    def recording(self, run: str, table: Sequence[int]) -> Iterator[None]:
        """Records run ``run`` for the sequence whose block table is ``table``."""
        self._run = run
        self.runner.execute = lambda work, fed=None: self._execute(table[0], work, fed)  # type: ignore[method-assign]
        try:
            yield
        finally:
            self._run = None
            del self.runner.execute

    def first_difference(self, a: str, b: str) -> Difference | None:
        """The earliest position where runs ``a`` and ``b`` differ, and there the first module."""
        for position in sorted(self.runs[a].keys() & self.runs[b].keys()):
            left, right = self.runs[a][position], self.runs[b][position]
            for name in self.order:
                if name in left and name in right and not torch.equal(left[name], right[name]):
                    amount = (left[name] - right[name]).abs().max().item()
                    return Difference(position, name, amount)
        return None

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
