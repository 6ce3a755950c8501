"""A hybrid model's decode CUDA graphs take its state slots as inputs (worker/model/cuda_graphs.py,
``StateInputs``): the forward a graph captures, run on the CPU over the graphs' buffers (staged
rows, a fresh sequence among them, padding to the bucket on the scratch slot), gives the eager
step's logits and leaves every slot's state as the eager step does. The capture itself needs CUDA
(make gpu-check)."""

from __future__ import annotations

import pytest
import torch

from tests.tiny_families import tiny_config, tiny_model
from tests.unit.worker.test_model_families import BLOCK, VOCAB, loaded
from worker.model.cuda_graphs import DecodeGraphs
from worker.model.runner import ModelRunner
from worker.model.step_inputs import Work

pytestmark = pytest.mark.slow  # left out of make test-fast

WIDTH = 8  # blocks per sequence's table


def prompt(seed: int, length: int) -> list[int]:
    return [(seed + 7 * i + (i * i) % 5) % VOCAB for i in range(length)]


def table(sequence: int) -> list[int]:
    return list(range(sequence * WIDTH, (sequence + 1) * WIDTH))


@pytest.mark.parametrize("family", ["qwen3_5_text", "granitemoehybrid", "lfm2"])
def test_the_captured_forward_over_state_slots_equals_the_eager_step(family: str) -> None:
    model = tiny_model(tiny_config(family))
    runners = [ModelRunner(loaded(model), num_blocks=48, block_size=BLOCK, max_sequences=4) for _ in range(2)]
    eager, graphed = runners
    graphs = DecodeGraphs(graphed, max_rows=4, context_length=WIDTH * BLOCK)
    assert graphs.states is not None
    # Sequence 1 ends after its prompt; sequence 3 then starts in its state slot (a used one).
    prompts = {0: prompt(3, 9), 1: prompt(11, 6), 2: prompt(5, 13)}
    for runner in runners:
        for sequence, ids in prompts.items():
            runner.execute([Work(ids, 0, table(sequence), True, state_slot=sequence)])
    known = {sequence: list(ids) for sequence, ids in prompts.items()}
    padded = False
    for step in range(4):
        work = [
            Work([known[s][-1] + step], len(known[s]) + step, table(s), True, state_slot=s) for s in (0, 2)
        ]
        if step == 1:  # a sequence that starts with a one-token prompt: the slot's state zeroed first
            work.append(Work([9], 0, table(3), True, state_slot=1))
        elif step > 1:
            work.append(Work([9 + step], step - 1, table(3), True, state_slot=1))
        want = eager.execute(work)
        bucket = graphs.stage(work)
        padded |= bucket > len(work)
        got = graphs.forward(bucket, None)[: len(work)]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=f"step {step}")
    assert padded  # a bucket's padding row ran on the scratch slot
    assert eager.states is not None and graphed.states is not None
    for layer, states in eager.states.conv.items():
        # Every sequence slot as the eager steps left it (the scratch slot is each path's own).
        torch.testing.assert_close(graphed.states.conv[layer][:4], states[:4], atol=1e-5, rtol=1e-5)
        if layer in eager.states.recurrent:
            torch.testing.assert_close(
                graphed.states.recurrent[layer][:4], eager.states.recurrent[layer][:4], atol=1e-5, rtol=1e-5
            )
