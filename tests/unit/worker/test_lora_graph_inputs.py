"""LoRA adapters in the decode CUDA graphs (worker/model/cuda_graphs.py, ``LoraInputs``): each row's
adapter slot is a graph input. The forward a graph captures, run on the CPU over the graphs' buffers
through the runner's own decode path (rows of two adapters, base rows, a verifying row under an
adapter, padding to the bucket, and a slot refilled with a third adapter after the buffers were
made), gives the eager step's logits; and it does not when the rows' slots are not staged. The
capture itself needs CUDA (tests/unit/worker/test_cuda_path.py, make gpu-check)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from tests.tiny_families import tiny_config, tiny_model
from tests.unit.worker.test_model_families import BLOCK, VOCAB, loaded
from worker.lora.adapter import LoraWeights
from worker.lora.layers import LoraLayers
from worker.lora.ops import RowLoraOps
from worker.model.cuda_graphs import DecodeGraphs
from worker.model.runner import ModelRunner
from worker.model.step_inputs import Work
from worker.types import LoraHandle

pytestmark = pytest.mark.slow  # left out of make test-fast

WIDTH = 8  # blocks per sequence's table
MAX_RANK = 16


class CpuGraphs(DecodeGraphs):
    """The graphs with a replay replaced by running the captured forward over the staged buffers
    (the gather path: no CUDA, no capture), so the runner's decode steps go through them;
    ``unstaged``: the rows' adapter slots are overwritten with -1 after staging (a broken stage)."""

    unstaged = False

    def run(self, work: Sequence[Work], fed: torch.Tensor | None = None) -> torch.Tensor:
        bucket = self.stage(work, fed)
        if self.unstaged and self.lora is not None:
            self.lora.slots.fill_(-1)
        self.replays += 1
        self.adapter_replays += self._adapter_rows
        return self.forward(bucket, None)[: len(work)]


def adapter(layers: LoraLayers, uid: int, rank: int) -> LoraHandle:
    """A random adapter of ``rank`` over every wrapped projection (large enough to move logits)."""
    generator = torch.Generator().manual_seed(uid)
    modules = {
        name: (
            torch.randn(rank, features[0], generator=generator) * 0.3,
            torch.randn(features[1], rank, generator=generator) * 0.3,
        )
        for name, features in layers.targets.items()
    }
    return LoraHandle(f"adapter{uid}", uid, 2, LoraWeights(f"/adapters/{uid}", rank, modules))


def prompt(seed: int, length: int) -> list[int]:
    return [(seed + 7 * i + (i * i) % 5) % VOCAB for i in range(length)]


def table(sequence: int) -> list[int]:
    return list(range(sequence * WIDTH, (sequence + 1) * WIDTH))


@pytest.mark.parametrize("staged", [True, False], ids=["staged", "slots-not-staged"])
def test_the_captured_forward_with_adapter_slots_equals_the_eager_step(staged: bool) -> None:
    check_decode_against_eager(staged)


def check_decode_against_eager(
    staged: bool = True, row_ops: RowLoraOps | None = None, scaled: bool = False
) -> None:
    """Two runners over one tiny model's copies decode the same steps, eagerly and through the
    graphs' captured forward (``row_ops``: the graphs' per-row product; None: the CPU's), logits
    within 1e-5 (``scaled``: 1e-5 of the largest logit, for kernels that sum in another order);
    ``staged`` False: the graphs' slots stay -1, and every step with adapter rows must differ."""
    config = tiny_config("llama")
    runners = [
        ModelRunner(loaded(tiny_model(config)), num_blocks=6 * WIDTH, block_size=BLOCK) for _ in range(2)
    ]
    for runner in runners:
        runner.enable_lora(2, MAX_RANK)
    eager, graphed = runners
    assert graphed.lora is not None and eager.lora is not None
    if row_ops is not None:
        graphed.lora.row_ops = row_ops
    graphs = CpuGraphs(graphed, max_rows=8, context_length=WIDTH * BLOCK)
    assert graphs.adapters and graphs.lora is not None
    weights = [(layer.lora_a, layer.lora_b) for layer in graphed.lora.layers.values()]
    pointers = [(a.data_ptr(), b.data_ptr()) for a, b in weights]
    graphs.unstaged = not staged
    graphed.graphs = graphs
    # Adapters of the highest rank and of a small one; a third one refills a slot later.
    first, second, third = (adapter(eager.lora, uid, rank) for uid, rank in ((1, MAX_RANK), (2, 5), (3, 9)))
    lora = {0: first, 1: None, 2: second, 3: first, 4: None, 5: third}
    known = {s: prompt(3 + 4 * s, 5 + 2 * s) for s in lora}
    for runner in runners:
        for s in (0, 1, 2, 3, 4):
            runner.execute([Work(known[s], 0, table(s), True, lora=lora[s])])

    done = dict.fromkeys(lora, 0)  # decode tokens each sequence has had

    def row(s: int, token: int = 1) -> Work:
        done[s] += 1
        return Work([token], len(known[s]) + done[s] - 1, table(s), True, lora=lora[s])

    steps = [
        [row(s) for s in (0, 1, 2, 3)],  # two adapters and a base row: bucket 4
        [row(s, 2) for s in (4, 0, 2, 1, 3)],  # 5 rows: padded to bucket 8
        [row(s, 3) for s in (1, 4)],  # base rows only
    ]
    # A verifying row under the first adapter (it runs as three decode rows) beside base rows.
    verifying = Work([7, 8, 9], len(known[0]) + done[0], table(0), True, proposed=2, lora=first)
    steps.append([verifying, row(1, 4), row(4, 4)])
    results = []
    for work in steps:
        want = eager.execute(work)
        got = graphed.execute(work)
        results.append((got, want))
    # The third adapter refills the second's slot (in place): a later replay computes the third.
    for runner in runners:
        runner.execute([Work(known[5], 0, table(5), True, lora=third)])
    work = [row(5), row(3), row(1)]
    results.append((graphed.execute(work), eager.execute(work)))
    assert graphs.replays == len(results)  # every decode step went through the graphs
    assert graphs.adapter_replays == len(results) - 1  # all but the base-only step had adapter rows
    assert graphed.lora.slot_of(third, set()) == 1  # the slot the second adapter held
    assert [(a.data_ptr(), b.data_ptr()) for a, b in weights] == pointers
    for index, (got, want) in enumerate(results):
        if staged or index == 2:  # the base-only step needs no slots
            atol = 1e-5 * (float(want.abs().max()) if scaled else 1.0)
            torch.testing.assert_close(got, want, atol=atol, rtol=1e-5, msg=f"step {index}")
        else:
            assert not torch.allclose(got, want, atol=1e-3, rtol=1e-3), f"step {index}"
