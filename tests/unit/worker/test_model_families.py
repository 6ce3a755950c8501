"""Every open-model family over the paged pool against transformers' eager forward: chunked
prompts, decode rows and mixed steps of sequences at different lengths, prompts longer than the
window (tiny random models, tests/tiny_families.py); on the CPU gather path here, through the
Triton decode kernel in triton's interpreter (a child process, see test_triton_decode.py); and
the architectures that are refused at load."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import transformers

from tests.tiny_families import COMMON, FAMILIES, WINDOW, eager_reference, tiny_config, tiny_model
from tests.triton_interpreter import interpreted_results, print_results
from worker.attention.triton_decode import triton_available
from worker.model import runner_setup
from worker.model.loader import ModelLoadError
from worker.model.runner import ModelRunner
from worker.model.step_inputs import Work

pytestmark = pytest.mark.slow  # left out of make test-fast

BLOCK = 4
VOCAB = COMMON["vocab_size"]


def loaded(model: Any, context_length: int = 256) -> SimpleNamespace:
    return SimpleNamespace(
        model=model, device=torch.device("cpu"), dtype=torch.float32, context_length=context_length
    )


@dataclass
class Sequence:
    """One sequence of the scenario: its known tokens, how many are computed, its blocks."""

    tokens: list[int]
    table: list[int]
    computed: int = 0
    checks: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (position, logits)

    def work(self, count: int | None) -> Work:
        """The next ``count`` known tokens (None: all the rest), or one new decode token."""
        if self.computed == len(self.tokens):
            self.tokens.append((len(self.tokens) * 37 + 11) % VOCAB)
        end = len(self.tokens) if count is None else self.computed + count
        item = Work(self.tokens[self.computed : end], self.computed, self.table, end == len(self.tokens))
        self.computed = end
        return item

    def verify(self, proposed: int) -> Work:
        """A verifying row: the next decode token and ``proposed`` more after it, each scored."""
        start = self.computed
        self.tokens += [(len(self.tokens) * 37 + 11 + i) % VOCAB for i in range(1 + proposed)]
        self.computed = len(self.tokens)
        return Work(self.tokens[start:], start, self.table, True, proposed=proposed)


def _prompt(length: int, seed: int) -> list[int]:
    return [(seed + 7 * i) % VOCAB for i in range(length)]


def run_scenario(runner: ModelRunner) -> list[Sequence]:
    """Prompts of 45, 41 and 13 tokens in chunks beside each other, then decode steps of all three
    (different lengths in one step), rows verifying speculative proposals (a negative count) beside
    decode rows, then a new prompt beside decode and verifying rows."""
    a, b = Sequence(_prompt(45, 3), list(range(0, 40, 2))), Sequence(_prompt(41, 5), list(range(1, 40, 2)))
    c = Sequence(_prompt(13, 9), [60, 41, 77, 50, 43])
    d = Sequence(_prompt(19, 1), [80, 81, 90, 82, 83, 84])
    steps: list[list[tuple[Sequence, int | None]]] = [
        [(a, 20), (b, None), (c, 5)],
        [(a, None), (b, None), (c, None)],  # b: a decode row beside two chunks
        [(a, None), (b, None), (c, None)],  # decode rows only
        [(c, -3), (a, None), (b, -1)],  # decode and verifying rows
        [(d, 9), (a, -2), (c, None)],  # a chunk beside them
        [(b, None), (d, None), (c, None), (a, None)],
    ]
    return _run_steps(runner, steps, [a, b, c, d])


def run_short_scenario(runner: ModelRunner) -> list[Sequence]:
    """The same kinds of rows in a quarter of the tokens, for kernels that triton's interpreter runs
    (every program instance in Python): a chunk beside a whole prompt, the chunk's rest beside a
    decode row, a verifying row beside a decode row, then decode rows past the windows."""
    a = Sequence(_prompt(14, 3), list(range(0, 16, 2)))
    c = Sequence(_prompt(6, 9), [60, 41, 77, 50, 43])
    steps: list[list[tuple[Sequence, int | None]]] = [
        [(a, 9), (c, None)],
        [(a, None), (c, None)],
        [(c, -2), (a, None)],
        [(a, None), (c, None)],
    ]
    return _run_steps(runner, steps, [a, c])


def _run_steps(
    runner: ModelRunner, steps: list[list[tuple[Sequence, int | None]]], sequences: list[Sequence]
) -> list[Sequence]:
    """Runs each step's rows through ``runner``, keeping the logits of every row that samples."""
    for step in steps:
        items = [
            sequence.verify(-count) if count is not None and count < 0 else sequence.work(count)
            for sequence, count in step
        ]
        logits = iter(runner.execute(items))
        for (sequence, _), item in zip(step, items, strict=True):
            if item.sample:
                first = sequence.computed - 1 - item.proposed
                for position in range(first, sequence.computed):
                    sequence.checks.append((position, next(logits).clone()))
        assert next(logits, None) is None
    return sequences


def check_against_reference(reference: Any, sequences: list[Sequence]) -> None:
    """Each checked row equals ``reference``'s logits of the sequence at that position."""
    for index, sequence in enumerate(sequences):
        with torch.inference_mode():
            want = reference(input_ids=torch.tensor([sequence.tokens])).logits[0]
        for position, got in sequence.checks:
            torch.testing.assert_close(
                got,
                want[position],
                atol=2e-4,
                rtol=1e-4,
                msg=f"sequence {index} at position {position}",
            )


def check_family(family: str, triton_decode: bool = False) -> None:
    """The family through the paged runner equals its eager forward (the short scenario where the
    Triton kernel runs in the interpreter)."""
    model = tiny_model(tiny_config(family))
    reference = eager_reference(model)
    runner = ModelRunner(loaded(model), num_blocks=100, block_size=BLOCK, triton_decode=triton_decode)
    scenario = run_short_scenario if triton_decode else run_scenario
    check_against_reference(reference, scenario(runner))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_over_the_paged_pool_equals_eager(family: str) -> None:
    check_family(family)


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss", "ministral", "mistral_window", "gemma4_text"])
def test_prompt_scoring_equals_eager(family: str) -> None:
    """The cacheless forward (prompt logprobs) applies the same windows, softcap and sinks."""
    model = tiny_model(tiny_config(family))
    reference = eager_reference(model)
    runner = ModelRunner(loaded(model), num_blocks=8, block_size=BLOCK)
    prompt = [(5 + 7 * i) % VOCAB for i in range(40)]
    scored = runner.score(prompt, 0)
    with torch.inference_mode():
        want = torch.log_softmax(reference(input_ids=torch.tensor([prompt])).logits[0, :-1], dim=-1)
    expected = want.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor([s.logprob for s in scored]), expected, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("family", "change"),
    [
        ("mistral_window", {"sliding_window": None}),
        ("gemma2", {"attn_logit_softcapping": None}),
        ("gpt_oss", {"sliding_window": 10_000}),
    ],
)
def test_the_feature_matters_at_these_sizes(family: str, change: dict[str, Any]) -> None:
    """The scenario's sizes make each feature change the logits (so the tests above would see it
    ignored)."""
    model = tiny_model(tiny_config(family))
    other = tiny_model(tiny_config(family, **change))
    other.load_state_dict(model.state_dict())
    ids = torch.tensor([[(3 + 7 * i) % VOCAB for i in range(45)]])
    with torch.inference_mode():
        assert not torch.allclose(
            model(input_ids=ids).logits[0, -1], other(input_ids=ids).logits[0, -1], atol=1e-2
        )


def test_gpt_oss_sinks_matter() -> None:
    model = tiny_model(tiny_config("gpt_oss"))
    ids = torch.tensor([[(3 + 7 * i) % VOCAB for i in range(45)]])
    with torch.inference_mode():
        before = model(input_ids=ids).logits[0, -1]
        for layer in model.model.layers:
            layer.self_attn.sinks.fill_(-1e4)
        assert not torch.allclose(before, model(input_ids=ids).logits[0, -1], atol=1e-2)


def test_gemma4_pool_has_each_layers_geometry_and_shared_layers_hold_no_blocks() -> None:
    """Sliding layers [blocks, 4, 2, 16], global ones [blocks, 4, 2, 32]; the two KV-sharing layers
    hold their source's tensors (the last earlier layer of their kind) and cost nothing."""
    runner = ModelRunner(loaded(tiny_model(tiny_config("gemma4_text"))), num_blocks=8, block_size=BLOCK)
    pool = runner.pool
    assert [tuple(keys.shape) for keys in pool.keys] == [
        (9, BLOCK, 2, 16),
        (9, BLOCK, 2, 32),
        (9, BLOCK, 2, 16),
        (9, BLOCK, 2, 16),
        (9, BLOCK, 2, 32),
    ]
    assert pool.keys[3] is pool.keys[2] and pool.values[3] is pool.values[2]
    assert pool.keys[4] is pool.keys[1] and pool.values[4] is pool.values[1]
    assert runner.kv_shape.bytes_per_token == 2 * 4 * (2 * 16 + 2 * 32 + 2 * 16)  # float32, 3 layers
    assert runner.attention.windows == (WINDOW, None, WINDOW, WINDOW, None)


def test_the_start_up_memory_probe_runs_gemma4() -> None:
    """The probe keeps the last token's logits as serving does (a tensor): with an int,
    transformers' Gemma 4 cuts its KV-sharing layers' queries to that many tokens, which the
    step's chunk does not describe."""
    runner_setup.take_activation_memory(loaded(tiny_model(tiny_config("gemma4_text"))), 24, BLOCK)  # type: ignore[arg-type]


def test_gemma4_global_layers_have_their_own_kv_heads() -> None:
    runner = ModelRunner(
        loaded(tiny_model(tiny_config("gemma4_text_k_eq_v"))), num_blocks=8, block_size=BLOCK
    )
    assert [(layer.kv_heads, layer.head_dim, layer.group) for layer in runner.kv_shape.layers] == [
        (2, 16, 2),
        (2, 16, 2),
        (1, 32, 4),
    ]


def test_window_at_or_above_the_context_is_no_window() -> None:
    model = tiny_model(tiny_config("mistral", sliding_window=4096))
    runner = ModelRunner(loaded(model, context_length=256), num_blocks=8, block_size=BLOCK)
    assert runner.attention.windows == (None, None)
    windowed = ModelRunner(loaded(tiny_model(tiny_config("gemma3_text"))), num_blocks=8, block_size=BLOCK)
    assert windowed.attention.windows == (WINDOW, WINDOW, None)


def test_mla_is_refused_at_load_naming_the_architecture() -> None:
    config = transformers.DeepseekV3Config(
        **{**COMMON, "num_hidden_layers": 1},
        kv_lora_rank=16,
        q_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
    )
    config.architectures = ["DeepseekV3ForCausalLM"]
    with pytest.raises(ModelLoadError, match=r"DeepseekV3ForCausalLM \(deepseek_v3\) uses multi-head latent"):
        ModelRunner(loaded(tiny_model(config)), num_blocks=4, block_size=BLOCK)


# The unserved hybrids are refused in test_hybrid_families.py.


# Every family's decode rows through the Triton kernel, in one interpreter child process.
KERNEL_CHECKS = {family: partial(check_family, family, triton_decode=True) for family in FAMILIES}


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, str | None]:
    return interpreted_results("tests.unit.worker.test_model_families")


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
@pytest.mark.parametrize("family", list(KERNEL_CHECKS))
def test_family_on_the_triton_decode_kernel_equals_eager(
    family: str, interpreter_results: dict[str, str | None]
) -> None:
    failure = interpreter_results[family]
    assert failure is None, failure


if __name__ == "__main__":  # the child process of `interpreter_results`
    print_results(KERNEL_CHECKS)
