"""Host synchronisations of a sampled step, counted on the CPU through wrappers (issue 25)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from worker.sampling.sampler import SequenceSampling, sample_batch
from worker.types import SamplingOptions


class AllowEven:
    """A grammar stand-in whose mask allows the even token ids."""

    def __init__(self, vocab: int):
        self.mask_words = -(-vocab // 32)

    def fill_mask(self, row: torch.Tensor) -> None:
        row.fill_(0x55555555)

    def advance(self, token_id: int) -> None:
        pass


def count_syncs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Counts what would block the host on CUDA: reading a tensor on the host (tolist, item, cpu,
    numpy, bool/int/float), nonzero, ``torch.tensor(..., device=...)`` and blocking ``.to``."""
    seen: list[str] = []
    for name in ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "nonzero"):
        original = getattr(torch.Tensor, name)

        def wrapper(self: torch.Tensor, *args: Any, _name: str = name, _f: Any = original, **kw: Any) -> Any:
            seen.append(_name)
            return _f(self, *args, **kw)

        monkeypatch.setattr(torch.Tensor, name, wrapper)
    tensor, to = torch.tensor, torch.Tensor.to

    def counted_tensor(*args: Any, **kw: Any) -> torch.Tensor:
        if kw.get("device") is not None:
            seen.append("tensor(device=)")
        return tensor(*args, **kw)

    def counted_to(self: torch.Tensor, *args: Any, **kw: Any) -> torch.Tensor:
        moves = any(isinstance(a, (torch.device, str)) for a in args) or "device" in kw
        if moves and not kw.get("non_blocking", False):
            seen.append("to(device)")
        return to(self, *args, **kw)

    monkeypatch.setattr(torch, "tensor", counted_tensor)
    monkeypatch.setattr(torch.Tensor, "to", counted_to)
    return seen


def test_a_sampled_step_with_top_p_and_a_grammar_syncs_once(monkeypatch: pytest.MonkeyPatch) -> None:
    vocab, count = 1000, 256
    options = SamplingOptions(temperature=0.8, top_p=0.9, seed=3)
    rows = [SequenceSampling(options, (1, 2), frozenset(), seed_offset=i) for i in range(count)]
    for row in rows:
        row.constraint = AllowEven(vocab)  # type: ignore[assignment]
    logits = torch.randn((count, vocab), generator=torch.Generator().manual_seed(0))
    for step in range(3):  # the first step builds the batch's tensors, later ones reuse them
        with monkeypatch.context() as patch:
            seen = count_syncs(patch)
            samples = sample_batch(logits, rows)
        assert len(seen) <= 1, f"step {step}: {seen}"
        assert all(s.token_id % 2 == 0 for s in samples)
        for row, sample in zip(rows, samples, strict=True):
            row.record(sample.token_id)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (make gpu-check runs it)")
def test_on_cuda_a_sampled_256_row_step_syncs_at_most_once() -> None:
    """The same step on the device, counted by torch's own sync detector (every synchronising
    CUDA call warns), over the real 49k vocabulary of the default model."""
    import warnings

    vocab, count = 49152, 256
    options = SamplingOptions(temperature=0.8, top_p=0.9, seed=3)
    rows = [SequenceSampling(options, (1, 2), frozenset(), seed_offset=i) for i in range(count)]
    for row in rows:
        row.constraint = AllowEven(vocab)  # type: ignore[assignment]
    logits = torch.randn((count, vocab), device="cuda")
    counts = []
    for _ in range(3):
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                samples = sample_batch(logits, rows)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        counts.append(sum("synchroniz" in str(w.message) for w in seen))
        assert all(s.token_id % 2 == 0 for s in samples)
        for row, sample in zip(rows, samples, strict=True):
            row.record(sample.token_id)
    print(f"\nhost syncs of a sampled 256-row step (temperature, top-p, grammar mask): {counts}")
    assert max(counts[1:]) <= 1, counts
