"""The runner over the paged pool against the same model's own forward (tiny random models)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from worker.model.runner import ModelRunner
from worker.model.step_inputs import Work


def loaded(model) -> SimpleNamespace:  # type: ignore[no-untyped-def]
    return SimpleNamespace(model=model, device=torch.device("cpu"), dtype=torch.float32)


def test_chunks_and_decode_rows_in_one_forward_equal_the_model_alone():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=300,
        hidden_size=96,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,  # GQA: 3 query heads per key/value head
        max_position_embeddings=512,
    )
    reference = LlamaForCausalLM(config).eval()
    model = LlamaForCausalLM(
        copy.deepcopy(config)
    ).eval()  # its own config: the runner switches its attention
    model.load_state_dict(reference.state_dict())
    runner = ModelRunner(loaded(model), num_blocks=16, block_size=4)

    def alone(tokens: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return reference(input_ids=torch.tensor([tokens])).logits[0, -1]

    a, b = list(range(5, 18)), list(range(40, 47))
    table_a, table_b = [9, 2, 7, 0], [4, 5, 11]  # scattered blocks
    # Step 1: the first chunk of a (no sample) and all of b, in one flat forward.
    out = runner.execute([Work(a[:6], 0, table_a, False), Work(b, 0, table_b, True)])
    assert out.shape == (1, 300) and torch.allclose(out[0], alone(b), atol=1e-4)
    # Step 2: the rest of a (a chunk that reaches the end) with b's first decode row.
    out = runner.execute([Work(a[6:], 6, table_a, True), Work([99], 7, table_b, True)])
    assert torch.allclose(out[0], alone(a), atol=1e-4) and torch.allclose(out[1], alone([*b, 99]), atol=1e-4)
    # Step 3: decode rows only (the [rows, 1] path).
    out = runner.execute([Work([100], 13, table_a, True), Work([101], 8, table_b, True)])
    assert torch.allclose(out[0], alone([*a, 100]), atol=1e-4)
    assert torch.allclose(out[1], alone([*b, 99, 101]), atol=1e-4)


@pytest.mark.parametrize("rows", [1, 3])
def test_decode_inputs_have_standard_strides_for_the_kernel(rows):
    # The Triton kernel reads seq_lens' and block_tables' strides: a one-row batch must not carry
    # the packed host tensor's row stride.
    from worker.model.step_inputs import Work, decode_inputs

    work = [Work([5], 3 + k, [k, k + 1], True) for k in range(rows)]
    inputs = decode_inputs(work, 4, torch.device("cpu"), torch.int32)
    assert inputs.lengths.stride() == (1,) and inputs.tables.stride(1) == 1
    assert inputs.tables.stride(0) == inputs.tables.shape[1]
    assert inputs.lengths.tolist() == [4 + k for k in range(rows)]
