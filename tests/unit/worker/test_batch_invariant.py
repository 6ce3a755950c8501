"""Batch-invariant steps (``--batch-invariant``): a sequence's logits are the same bits whatever
its steps held (tiny random Llama with int4/int8 weight-only layers, on the CPU kernels)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tests.invariance_probe import Difference, RowProbe
from tests.tiny_families import eager_reference, tiny_config, tiny_model
from tests.unit.worker.test_model_families import check_against_reference, run_scenario
from tests.unit.worker.test_paged_runner import loaded
from worker.attention import paged
from worker.model.loader import ModelLoadError
from worker.model.runner import ModelRunner
from worker.model.step_inputs import Work
from worker.quant.layers import cpu_kernels_available, quantize_linears

pytestmark = pytest.mark.skipif(not cpu_kernels_available(), reason="no int4/int8 CPU kernels in this torch")

BLOCK = 4
PROMPT = list(range(5, 75))  # 70 tokens: with what it generates, past the 64-token key padding
COMPANIONS = [list(range(100 + 40 * j, 100 + 40 * j + 90 + 11 * j)) for j in range(3)]  # longer contexts
STEPS = 30


def tiny_int4_model() -> SimpleNamespace:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=300,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA: 2 query heads per key/value head
        max_position_embeddings=512,
    )
    model = LlamaForCausalLM(config).eval()
    quantize_linears(model, "int4")
    return loaded(model)


def table(seq: int) -> list[int]:
    return list(range(seq * 50, seq * 50 + 50))  # 200 tokens of blocks per sequence


def alone(runner: ModelRunner) -> tuple[list[int], list[torch.Tensor]]:
    """The prompt in one step, then greedy decode steps with nothing else in them."""
    logits = [runner.execute([Work(PROMPT, 0, table(0), True)])[0]]
    generated: list[int] = []
    for i in range(STEPS):
        generated.append(int(logits[-1].argmax()))
        logits.append(runner.execute([Work([generated[-1]], len(PROMPT) + i, table(0), True)])[0])
    return generated, logits


def crowded(runner: ModelRunner, generated: list[int]) -> list[torch.Tensor]:
    """The same sequence (fed the same tokens), its prompt in three chunks beside other sequences'
    decode rows, then decoded beside 0 to 3 rows with longer contexts."""
    lengths = []
    for j, tokens in enumerate(COMPANIONS):
        runner.execute([Work(tokens, 0, table(j + 1), True)])
        lengths.append(len(tokens))

    def companions(count: int) -> list[Work]:
        rows = [Work([7 + j], lengths[j], table(j + 1), True) for j in range(count)]
        for j in range(count):
            lengths[j] += 1
        return rows

    runner.execute([Work(PROMPT[:9], 0, table(4), False), *companions(3)])
    runner.execute([*companions(2), Work(PROMPT[9:40], 9, table(4), False)])
    logits = [runner.execute([Work(PROMPT[40:], 40, table(4), True), *companions(1)])[0]]
    for i, token in enumerate(generated):
        out = runner.execute([*companions(i % 4), Work([token], len(PROMPT) + i, table(4), True)])
        logits.append(out[-1])
    return logits


def resumed(runner: ModelRunner, generated: list[int], k: int) -> torch.Tensor:
    """Prompt plus the first ``k`` generated tokens as one new prompt (a moved stream's resume)."""
    return runner.execute([Work(PROMPT + generated[:k], 0, table(5), True)])[0]


def test_a_sequence_computes_the_same_bits_alone_crowded_chunked_and_resumed(monkeypatch):
    monkeypatch.setattr(paged, "INVARIANT_TILE_BYTES", 64 << 10)  # several gather tiles per step
    runner = ModelRunner(tiny_int4_model(), num_blocks=300, block_size=BLOCK, batch_invariant=True)
    generated, reference = alone(runner)
    for step, (got, want) in enumerate(zip(crowded(runner, generated), reference, strict=True)):
        assert torch.equal(got, want), f"step {step}: max difference {(got - want).abs().max().item()}"
    for k in (0, 1, 13, STEPS):
        assert torch.equal(resumed(runner, generated, k), reference[k]), f"resumed after {k} tokens"


def test_the_same_scenario_differs_without_the_setting():
    """The scenario above is sensitive: the default steps (SDPA by shape, float copies of the
    weights for batches) round the same sequence differently."""
    runner = ModelRunner(tiny_int4_model(), num_blocks=300, block_size=BLOCK)
    generated, reference = alone(runner)
    got = crowded(runner, generated) + [resumed(runner, generated, k) for k in (13, STEPS)]
    want = [*reference, reference[13], reference[STEPS]]
    assert not all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_float_linear_layers_are_refused_with_the_setting_named():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=100, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4
    )
    float_model = loaded(LlamaForCausalLM(config).eval())
    with pytest.raises(
        ModelLoadError, match=r"--batch-invariant needs .*--quantization int4 or int8.*q_proj"
    ):
        ModelRunner(float_model, num_blocks=8, block_size=BLOCK, batch_invariant=True)


def tiny_family_int4(family: str) -> SimpleNamespace:
    """A tiny model of ``family`` (tests/tiny_families.py) on int4 layers."""
    model = tiny_model(tiny_config(family, vocab_size=300))
    quantize_linears(model, "int4")
    return loaded(model)


@pytest.mark.parametrize("family", ["mistral_window", "gemma2", "gemma3_text", "gpt_oss"])
def test_windows_softcap_and_sinks_in_batch_invariant_steps_equal_eager(family: str) -> None:
    """The batch-invariant attention on float layers (which the setting refuses only because their
    kernels round a row by its batch), so float32 tolerance holds."""
    model = tiny_model(tiny_config(family))
    reference = eager_reference(model)
    runner = ModelRunner(loaded(model), num_blocks=100, block_size=BLOCK)
    runner.batch_invariant = True
    check_against_reference(reference, run_scenario(runner))


def step_of(difference: Difference) -> str:
    """Which step of :func:`alone` computed the differing position (0: the prompt's step)."""
    return f"step {max(0, difference.position - len(PROMPT) + 1)}, {difference}"


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_windows_softcap_and_sinks_keep_steps_batch_invariant(family: str, monkeypatch) -> None:
    """Every module's input and output row for the sequence is the same bits alone and crowded (stricter
    than the logits, which bfloat16 rounding makes differ seldom and late: a float32 MoE expert
    product rounded by its batch differed here at 30 positions while the logits matched), and a
    failure names the first module that differs."""
    monkeypatch.setattr(paged, "INVARIANT_TILE_BYTES", 64 << 10)
    runner = ModelRunner(tiny_family_int4(family), num_blocks=300, block_size=BLOCK, batch_invariant=True)
    probe = RowProbe(runner)
    with probe.recording("alone", table(0)):
        generated, reference = alone(runner)
    with probe.recording("crowded", table(4)):
        got = crowded(runner, generated)
    probe.close()
    difference = probe.first_difference("alone", "crowded")
    assert difference is None, step_of(difference)
    for step, (row, want) in enumerate(zip(got, reference, strict=True)):
        assert torch.equal(row, want), f"step {step}: max difference {(row - want).abs().max().item()}"


def test_a_float_matrix_outside_the_kernels_is_refused_by_name():
    """A product the check does not know (here a 3-D float parameter without transformers'
    experts flags) would round a row by its batch: refused, named, rather than served."""
    model = tiny_int4_model().model
    model.model.layers[0].mlp.register_parameter("mixer", torch.nn.Parameter(torch.randn(2, 8, 8)))
    with pytest.raises(ModelLoadError, match=r"--batch-invariant needs .*layers\.0\.mlp\.mixer"):
        ModelRunner(loaded(model), num_blocks=8, block_size=BLOCK, batch_invariant=True)


def test_sink_rows_round_alike_whatever_the_tiles_size(monkeypatch):
    """gpt-oss's sinks: an elementwise op over a tile rounds the elements of its vector part and
    of its scalar tail differently (torch.sigmoid: ~4% of values differ by an ulp), and the tile's
    token count decides which tokens fall in the tail. Injected here as a sigmoid that moves every
    element of whole 32-element blocks by one ulp (AVX-512's split); a prompt's rows, the
    attention's output (``o_proj``'s input) included, must not change when a companion joins its
    step."""
    sigmoid = torch.sigmoid

    def split_sigmoid(x: torch.Tensor) -> torch.Tensor:
        out = sigmoid(x).reshape(-1)
        vector = out.numel() // 32 * 32
        out[:vector] = torch.nextafter(out[:vector], torch.tensor(float("inf")))
        return out.view(x.shape)

    monkeypatch.setattr(torch, "sigmoid", split_sigmoid)
    runner = ModelRunner(tiny_family_int4("gpt_oss"), num_blocks=300, block_size=BLOCK, batch_invariant=True)
    probe = RowProbe(runner)
    prompt = PROMPT[:20]  # 20 tokens x 4 heads: 64 elements in blocks, the last 4 tokens in the tail
    with probe.recording("alone", table(0)):
        runner.execute([Work(prompt, 0, table(0), True)])
    with probe.recording("crowded", table(1)):  # 33 tokens: the prompt's tail now in a block
        runner.execute([Work(prompt, 0, table(1), True), Work(COMPANIONS[0][:13], 0, table(2), True)])
    probe.close()
    difference = probe.first_difference("alone", "crowded")
    assert difference is None, str(difference)
