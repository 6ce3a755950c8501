"""``--batch-invariant`` on hybrid models (worker/model/serial_states.py): the recurrent mixers take
each token alone, so a sequence's logits and every module's row are the same bits alone, crowded
(prompt in chunks beside other sequences' decode rows, decode beside 0 to 3 rows), resumed (prompt
and generated tokens as one new prompt) and verifying proposals (tiny Qwen3.5, Granite 4 hybrid,
LFM2 on int8 layers); and they follow the eager forward of the same weights. In the style of
test_batch_invariant.py, without its per-module probe (the mixers run once per token here)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.tiny_families import eager_reference, tiny_config, tiny_model
from tests.unit.worker.test_model_families import loaded
from worker.model.runner import ModelRunner
from worker.model.step_inputs import Work
from worker.quant.layers import cpu_kernels_available, quantize_linears

pytestmark = [
    pytest.mark.skipif(not cpu_kernels_available(), reason="no int4/int8 CPU kernels in this torch"),
    pytest.mark.slow,  # left out of make test-fast
]

FAMILIES = ["qwen3_5_text", "granitemoehybrid", "lfm2"]
BLOCK = 4
PROMPT = [(5 + 7 * i) % 128 for i in range(13)]
COMPANIONS = [[(11 + 5 * i + j) % 128 for i in range(3 + 2 * j)] for j in range(3)]
STEPS = 3


def int8_model(family: str) -> SimpleNamespace:
    model = tiny_model(tiny_config(family))
    quantize_linears(model, "int8")
    return loaded(model)


def table(seq: int) -> list[int]:
    return list(range(seq * 20, seq * 20 + 20))  # 80 tokens of blocks per sequence


def runner_of(family: str) -> ModelRunner:
    return ModelRunner(
        int8_model(family), num_blocks=200, block_size=BLOCK, batch_invariant=True, max_sequences=4
    )


def alone(runner: ModelRunner) -> tuple[list[int], list[torch.Tensor]]:
    """The prompt in one step (state slot 0), then greedy decode steps with nothing else in them."""
    logits = [runner.execute([Work(PROMPT, 0, table(0), True, state_slot=0)])[0]]
    generated: list[int] = []
    for i in range(STEPS):
        generated.append(int(logits[-1].argmax()))
        logits.append(
            runner.execute([Work([generated[-1]], len(PROMPT) + i, table(0), True, state_slot=0)])[0]
        )
    return generated, logits


def crowded(runner: ModelRunner, generated: list[int]) -> list[torch.Tensor]:
    """The same sequence again (slot 0, restarted from position 0), its prompt in three chunks
    beside other sequences' decode rows (slots 1-3), then decoded beside 0 to 3 of them."""
    lengths = []
    for j, tokens in enumerate(COMPANIONS):
        runner.execute([Work(tokens, 0, table(j + 1), True, state_slot=j + 1)])
        lengths.append(len(tokens))

    def companions(count: int) -> list[Work]:
        rows = [Work([7 + j], lengths[j], table(j + 1), True, state_slot=j + 1) for j in range(count)]
        for j in range(count):
            lengths[j] += 1
        return rows

    runner.execute([Work(PROMPT[:5], 0, table(4), False, state_slot=0), *companions(3)])
    runner.execute([*companions(2), Work(PROMPT[5:9], 5, table(4), False, state_slot=0)])
    logits = [runner.execute([Work(PROMPT[9:], 9, table(4), True, state_slot=0), *companions(1)])[0]]
    for i, token in enumerate(generated):
        out = runner.execute(
            [*companions(i % 4), Work([token], len(PROMPT) + i, table(4), True, state_slot=0)]
        )
        logits.append(out[-1])
    return logits


@pytest.mark.parametrize("family", FAMILIES)
def test_a_hybrid_sequence_computes_the_same_bits_alone_crowded_and_resumed(family: str) -> None:
    """Invariant, and right: alone, the sequence follows the eager forward of the same int8 weights
    within test_hybrid_families' bound for quantized hybrids."""
    model = int8_model(family)
    runner = ModelRunner(model, num_blocks=200, block_size=BLOCK, batch_invariant=True, max_sequences=4)
    generated, reference = alone(runner)
    for step, (row, want) in enumerate(zip(crowded(runner, generated), reference, strict=True)):
        assert torch.equal(row, want), f"step {step}: max difference {(row - want).abs().max().item()}"
    for k in (0, STEPS):  # a moved stream's resume: prompt and generated tokens as one prompt
        again = runner.execute([Work(PROMPT + generated[:k], 0, table(5), True, state_slot=2)])[0]
        assert torch.equal(again, reference[k]), f"resumed after {k} tokens"
    eager = eager_reference(tiny_model(tiny_config(family)))
    quantize_linears(eager, "int8")
    with torch.inference_mode():
        want = eager(input_ids=torch.tensor([PROMPT + generated])).logits[0, len(PROMPT) - 1 :]
    for step, got in enumerate(reference):
        assert float((got - want[step]).norm() / want[step].norm()) < 0.1, step


def test_verifying_proposals_keeps_the_bits_of_plain_decoding() -> None:
    """A verifying row (one proposal right, two wrong) scores its tokens as decoding them would,
    and after the accepted length is kept the next step equals plain decoding's, bit for bit."""
    runner = runner_of("qwen3_5_text")
    generated, reference = alone(runner)
    runner.execute([Work(PROMPT, 0, table(1), True, state_slot=1)])
    tokens = [generated[0], generated[1], (generated[2] + 1) % 128, 9]
    item = Work(tokens, len(PROMPT), table(1), True, proposed=3, state_slot=1)
    scored = runner.execute([item])
    assert torch.equal(scored[0], reference[1]) and torch.equal(scored[1], reference[2])
    runner.accepted(item, 1)
    following = runner.execute([Work([generated[2]], len(PROMPT) + 2, table(1), True, state_slot=1)])[0]
    assert torch.equal(following, reference[3])
