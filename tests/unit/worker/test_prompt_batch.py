"""Whole prompts attended together (worker/attention/prompt_batch.py): the groups, and a step of many
prompts of different lengths against each prompt through the model's own forward."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

from worker.attention import paged
from worker.attention.prompt_batch import group_prompts
from worker.model.runner import ModelRunner
from worker.model.step_inputs import Work


def test_groups_cover_every_token_once_with_padding_at_most_the_real_tokens() -> None:
    counts = [1, 40, 3, 38, 2, 9, 10, 1]
    starts = [sum(counts[:i]) for i in range(len(counts))]
    groups = group_prompts(list(zip(starts, counts, strict=True)), torch.device("cpu"))
    assert len(groups) > 1  # 40 next to 1 would be mostly padding
    seen: list[int] = []
    for group in groups:
        real = group.tokens.numel()
        assert group.prompts * group.longest <= 2 * real
        assert group.gather.numel() == group.prompts * group.longest
        # Each real token's padded position gathers that very token.
        assert torch.equal(group.gather[group.keep], group.tokens)
        seen += group.tokens.tolist()
    assert sorted(seen) == list(range(sum(counts)))


def test_padding_repeats_the_prompts_last_token() -> None:
    (group,) = group_prompts([(0, 3), (3, 2)], torch.device("cpu"))
    assert (group.prompts, group.longest) == (2, 3)
    assert group.gather.tolist() == [0, 1, 2, 3, 4, 4]
    assert group.keep.tolist() == [0, 1, 2, 3, 4]


def _models(kind: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    common = dict(
        vocab_size=300, hidden_size=96, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512,
    )  # fmt: skip
    if kind == "mistral":  # a sliding window narrower than the longer prompts
        config: LlamaConfig | MistralConfig = MistralConfig(**common, sliding_window=6)
        classes: type = MistralForCausalLM
    else:
        config, classes = LlamaConfig(**common), LlamaForCausalLM
    reference = classes(config).eval()
    model = classes(copy.deepcopy(config)).eval()  # its own config: the runner switches its attention
    model.load_state_dict(reference.state_dict())
    return reference, model


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_a_step_of_many_prompts_equals_each_prompt_alone(kind: str, monkeypatch) -> None:
    reference, model = _models(kind)
    runner = ModelRunner(
        SimpleNamespace(model=model, device=torch.device("cpu"), dtype=torch.float32),  # type: ignore[arg-type]
        num_blocks=64,
        block_size=4,
    )
    calls: list[int] = []
    attend = paged.attend_prompts
    monkeypatch.setattr(
        paged, "attend_prompts", lambda group, *a: calls.append(group.prompts) or attend(group, *a)
    )
    lengths = [1, 13, 5, 2, 9, 9, 3]
    prompts = [[(7 * i + 3 * t) % 290 + 5 for t in range(n)] for i, n in enumerate(lengths)]
    continued = list(range(50, 61))  # a sequence whose second chunk has context before it
    runner.execute([Work(continued[:4], 0, [60, 61, 62], False)])
    work = [Work(p, 0, [i * 4 + b for b in range(4)], True) for i, p in enumerate(prompts)]
    out = runner.execute([*work, Work(continued[4:], 4, [60, 61, 62], True)])
    assert calls  # the whole prompts went through the grouped attention
    with torch.inference_mode():
        for row, tokens in enumerate([*prompts, continued]):
            alone = reference(input_ids=torch.tensor([tokens])).logits[0, -1]
            torch.testing.assert_close(out[row], alone, atol=1e-4, rtol=1e-4)
