"""The hybrid families (recurrent mixers beside attention: Gated DeltaNet, Mamba-2, short
convolutions) over the paged pool and the state pool against transformers' eager forward: chunked
prompts crossing the mixers' chunks, decode rows, mixed steps of sequences at different lengths,
a one-token prompt, a restart after preemption in a slot another sequence used; the cacheless
scoring forward; the refusals (worker/model/recurrent.py, docs/worker.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import transformers

from tests.tiny_families import COMMON, HYBRID_FAMILIES, eager_reference, tiny_config, tiny_model
from tests.unit.worker.test_model_families import BLOCK, VOCAB, loaded
from worker.config import parse_config
from worker.model import recurrent, runner_setup
from worker.model.loader import ModelLoadError
from worker.model.runner import ModelRunner
from worker.model.step_inputs import Work

pytestmark = pytest.mark.slow  # left out of make test-fast

# float32, and yet looser than the attention families' 2e-4: the mixers' chunked scans sum in an
# order that depends on where a prompt is cut; transformers' own cache path (a 50-token prompt in
# two pieces against one forward) differs by 2.5e-4 on these models. A lost or stale state differs
# by orders of magnitude more (test_the_state_matters_across_chunks). Nemotron-H: transformers' own
# one-token decode path (cache) differs from its whole-prompt forward by up to 3e-3 on this model.
ATOL = {"nemotron_h": 5e-3}


def check_against_reference(reference: Any, sequences: list[Sequence], atol: float = 1e-3) -> None:
    """Each checked row equals ``reference``'s logits of the sequence at that position."""
    for index, sequence in enumerate(sequences):
        with torch.inference_mode():
            want = reference(input_ids=torch.tensor([sequence.tokens])).logits[0]
        for position, got in sequence.checks:
            torch.testing.assert_close(
                got, want[position], atol=atol, rtol=1e-4, msg=f"sequence {index} at position {position}"
            )


@dataclass
class Sequence:
    """One sequence of the scenario: its known tokens, how many are computed, its blocks and state slot."""

    tokens: list[int]
    table: list[int]
    slot: int
    computed: int = 0
    checks: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (position, logits)

    def work(self, count: int | None) -> Work:
        """The next ``count`` known tokens (None: all the rest), or one new decode token."""
        if self.computed == len(self.tokens):
            self.tokens.append((len(self.tokens) * 37 + 11) % VOCAB)
        end = len(self.tokens) if count is None else self.computed + count
        start = self.computed
        self.computed = end
        return Work(self.tokens[start:end], start, self.table, end == len(self.tokens), state_slot=self.slot)


def run_steps(runner: ModelRunner, steps: list[list[tuple[Sequence, int | None]]]) -> None:
    """Runs each step's items in one ``execute``, recording the sampled rows' logits."""
    for step in steps:
        items = [sequence.work(count) for sequence, count in step]
        logits = iter(runner.execute(items))
        for (sequence, _), item in zip(step, items, strict=True):
            if item.sample:
                sequence.checks.append((sequence.computed - 1, next(logits).clone()))
        assert next(logits, None) is None


def run_short_scenario(runner: ModelRunner) -> list[Sequence]:
    """The scenario's kinds of step, fewer of them: a chunked prompt crossing a Mamba chunk beside a
    whole one, a decode row beside a chunk, decode-only steps, then ``a`` restarted from position 0
    in ``b``'s slot (for checkpoints whose every forward is costly: 150k-word vocabularies)."""
    a, b = Sequence(prompt(13, 3), [0, 2, 4, 6, 8], 0), Sequence(prompt(6, 5), [1, 3, 5], 1)
    run_steps(runner, [[(a, 5), (b, None)], [(a, None), (b, None)], [(a, None), (b, None)]])
    restarted = Sequence(list(a.tokens), a.table, b.slot)
    run_steps(runner, [[(restarted, 9)], [(restarted, None)], [(restarted, None)]])
    return [a, b, restarted]


def prompt(length: int, seed: int) -> list[int]:
    return [(seed + 7 * i) % VOCAB for i in range(length)]


def run_scenario(runner: ModelRunner) -> list[Sequence]:
    """Prompts of 45, 41 and 13 tokens in chunks beside each other (Mamba chunks are 8 tokens), a
    decode row beside chunks, a one-token chunk continuing a prompt, a one-token prompt (a decode
    row at position 0), decode-only steps; then ``a`` restarts from position 0 (a preemption) in
    the slot ``c`` used, and decodes again."""
    a, b = (
        Sequence(prompt(45, 3), list(range(0, 40, 2)), 0),
        Sequence(prompt(41, 5), list(range(1, 40, 2)), 1),
    )
    c = Sequence(prompt(13, 9), [60, 41, 77, 50, 43], 2)
    d = Sequence(prompt(19, 1), [80, 81, 90, 82, 83, 84], 3)
    e = Sequence(prompt(1, 4), [70, 71], 4)
    run_steps(
        runner,
        [
            [(a, 20), (b, None), (c, 5)],
            [(a, None), (b, None), (c, 3)],  # b: a decode row beside two chunks
            [(a, None), (b, None), (c, None)],
            [(a, None), (b, None), (c, None)],  # decode rows only (the [rows, 1] batch)
            [(d, 9), (a, None), (c, None), (e, None)],  # e: a one-token prompt
            [(d, 1), (b, None), (e, None)],  # d: a one-token chunk continuing its prompt
            [(b, None), (d, None), (c, None), (a, None), (e, None)],
            [(b, None), (d, None), (c, None), (a, None), (e, None)],
        ],
    )
    # Preempted and restarted (recompute): from position 0 again, in a slot holding c's state.
    restarted = Sequence(list(a.tokens), a.table, c.slot)
    run_steps(runner, [[(restarted, 30), (b, None)], [(restarted, None)], [(restarted, None), (b, None)]])
    return [a, b, c, d, e, restarted]


def check_family(family: str) -> None:
    model = tiny_model(tiny_config(family))
    reference = eager_reference(model)
    runner = ModelRunner(loaded(model), num_blocks=100, block_size=BLOCK, max_sequences=8)
    assert runner.states is not None
    check_against_reference(reference, run_scenario(runner), ATOL.get(family, 1e-3))


@pytest.mark.parametrize("family", list(HYBRID_FAMILIES))
def test_hybrid_family_over_the_pools_equals_eager(family: str) -> None:
    check_family(family)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("family", ["qwen3_5_text", "granitemoehybrid"])
def test_quantized_hybrid_equals_its_quantized_eager_forward(family: str, scheme: str) -> None:
    """Weight-only int8/int4 layers inside the mixers (their projections are plain linear layers):
    the scenario over the pools follows the eager forward of the same quantized weights. The
    kernels round activations (bfloat16 for a row, a float16 copy for a batch), which moves an
    attention-only model's logits by 1-1.5 % here and these tiny random hybrids' by 2-7 % (their
    states carry it on); a state lost or misplaced moves them by far more (the float test above)."""
    from worker.quant.layers import quantize_linears

    model = tiny_model(tiny_config(family))
    reference = eager_reference(model)
    assert quantize_linears(model, scheme) == quantize_linears(reference, scheme) > 0
    runner = ModelRunner(loaded(model), num_blocks=100, block_size=BLOCK, max_sequences=8)
    for sequence in run_scenario(runner):
        with torch.inference_mode():
            want = reference(input_ids=torch.tensor([sequence.tokens])).logits[0]
        for position, got in sequence.checks:
            assert float((got - want[position]).norm() / want[position].norm()) < 0.1, position


@pytest.mark.parametrize("family", ["qwen3_5_text", "granitemoehybrid", "lfm2"])
def test_prompt_scoring_equals_eager(family: str) -> None:
    """The cacheless forward (prompt logprobs) runs the mixers as transformers wrote them."""
    model = tiny_model(tiny_config(family))
    reference = eager_reference(model)
    runner = ModelRunner(loaded(model), num_blocks=8, block_size=BLOCK)
    ids = prompt(40, 5)
    scored = runner.score(ids, 0)
    with torch.inference_mode():
        want = torch.log_softmax(reference(input_ids=torch.tensor([ids])).logits[0, :-1], dim=-1)
    expected = want.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor([s.logprob for s in scored]), expected, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["qwen3_5_text", "granitemoehybrid", "lfm2"])
def test_a_sequence_resumes_from_a_state_checkpoint(family: str) -> None:
    """``a``'s state after its first 16 tokens is kept in a checkpoint (``state_to``); ``b``, with the
    same first 16 tokens, starts at position 16 on ``a``'s blocks and that checkpoint
    (``state_from``), beside ``a``'s own next chunk, and equals eager on its whole sequence."""
    model = tiny_model(tiny_config(family))
    reference = eager_reference(model)
    runner = ModelRunner(loaded(model), num_blocks=100, block_size=BLOCK, max_sequences=4)
    a = Sequence(prompt(30, 3), list(range(10)), 0)
    b = Sequence([*a.tokens[:16], *prompt(11, 8)], [*a.table[:4], 20, 21, 22, 23, 24], 1, computed=16)
    first = a.work(16)
    logits = runner.execute([Work(first.tokens, first.start, first.table, False, state_slot=0, state_to=2)])
    assert logits.shape[0] == 0
    rest, resumed = a.work(None), b.work(None)
    both = runner.execute([rest, Work(resumed.tokens, 16, resumed.table, True, state_slot=1, state_from=2)])
    b.checks.append((26, both[1].clone()))
    run_steps(runner, [[(b, None)], [(b, None), (a, None)]])  # decode from the resumed state
    logits = runner.execute([Work(b.tokens[16:27], 16, b.table, True, state_slot=3, state_from=2)])
    b.checks.append((26, logits[0].clone()))  # again from the checkpoint, in another slot
    check_against_reference(reference, [b], ATOL.get(family, 1e-3))


def test_the_state_matters_across_chunks() -> None:
    """A chunk that continued from a zero state instead of its slot's differs from eager (so the
    scenario above would see a state lost between chunks)."""
    model = tiny_model(tiny_config("qwen3_5_text"))
    reference = eager_reference(model)
    runner = ModelRunner(loaded(model), num_blocks=100, block_size=BLOCK)
    a = Sequence(prompt(30, 3), list(range(10)), 0)
    run_steps(runner, [[(a, 20)]])
    assert runner.states is not None
    for tensors in (runner.states.conv, runner.states.recurrent):
        for tensor in tensors.values():
            tensor[0].zero_()
    run_steps(runner, [[(a, None)]])
    with pytest.raises(AssertionError):
        check_against_reference(reference, [a])


def test_state_pool_size_follows_the_slots() -> None:
    model = tiny_model(tiny_config("lfm2"))
    runner = ModelRunner(loaded(model), num_blocks=8, block_size=BLOCK, max_sequences=5)
    assert runner.states is not None
    assert runner.states.slots == 5
    # three conv layers of [hidden 64, kernel 3] float32 per slot: 5 slots, the scratch slot and
    # 5 prefix checkpoints
    assert runner.states.checkpoints == 5
    assert runner.states.bytes == 11 * 3 * 64 * 3 * 4
    attention_only = ModelRunner(loaded(tiny_model(tiny_config("llama"))), num_blocks=8, block_size=BLOCK)
    assert attention_only.states is None


@pytest.mark.parametrize(
    ("family", "attention"), [("lfm2", [1]), ("nemotron_h", [1]), ("granitemoehybrid", [1])]
)
def test_only_attention_layers_hold_kv_blocks(family: str, attention: list[int]) -> None:
    """A recurrent or MLP-only layer keeps no keys or values: the pool's memory is the attention
    layers' alone (3 of 4 layers' worth would be wasted otherwise)."""
    model = tiny_model(tiny_config(family))
    runner = ModelRunner(loaded(model), num_blocks=8, block_size=BLOCK, max_sequences=2)
    shape = runner.pool.shape
    assert [i for i in range(shape.num_layers) if shape.owns_blocks(i)] == attention
    layer = shape.layers[attention[0]]
    assert shape.bytes_per_token == len(attention) * 2 * layer.kv_heads * layer.head_dim * 4
    assert all(runner.pool.keys[i].numel() == 0 for i in range(shape.num_layers) if i not in attention)


def test_batch_invariant_mode_refuses_a_float_hybrid_naming_its_float_layers() -> None:
    """As for any model: float linear layers outside the mixers are refused (the mixers' own take
    one token at a time: test_batch_invariant_hybrid.py)."""
    model = tiny_model(tiny_config("qwen3_5_text"))
    with pytest.raises(ModelLoadError, match=r"--batch-invariant needs .*: model\.layers\.0\.mlp\.gate_proj"):
        ModelRunner(loaded(model), num_blocks=8, block_size=BLOCK, batch_invariant=True)


@pytest.mark.parametrize(
    ("config_class", "changes", "named"),
    [
        ("FalconMambaConfig", {}, "falcon_mamba"),
        ("JambaConfig", {"attn_layer_period": 2, "attn_layer_offset": 1}, "jamba"),
        ("BambaConfig", {}, "bamba"),
    ],
)
def test_unserved_hybrids_are_refused_at_load_naming_the_architecture(
    config_class: str, changes: dict[str, Any], named: str
) -> None:
    config = getattr(transformers, config_class)(**{**COMMON, **changes})
    model = SimpleNamespace(config=config, modules=lambda: iter(()))
    with pytest.raises(
        ModelLoadError, match=rf"\({config.model_type}\) is a hybrid.*{named}|{named}.*hybrid"
    ):
        ModelRunner(loaded(model), num_blocks=4, block_size=BLOCK)


def test_a_hybrid_type_without_known_mixers_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A transformers version whose mixer classes are renamed is refused in one line, not served
    without its states."""
    monkeypatch.setattr(recurrent, "MIXERS", frozenset({"SomethingElse"}))
    with pytest.raises(ModelLoadError, match=r"\(lfm2\): no recurrent mixer of a known form"):
        ModelRunner(loaded(tiny_model(tiny_config("lfm2"))), num_blocks=4, block_size=BLOCK)


def test_the_kept_verification_states_count_in_the_cuda_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA the state pool's share leaves the KV pool the rest: with --speculative, the states a
    step keeps per verified token (rows x tokens slot states) come out of it too (faked device)."""
    monkeypatch.setattr(runner_setup, "state_slot_bytes", lambda *args: 1000)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (10**9, 10**9))
    cuda = loaded(None)
    cuda.device = torch.device("cuda")
    plain = parse_config(["--max-running", "8"], environ={})
    ngram = parse_config(["--max-running", "8", "--speculative", "ngram"], environ={})
    (slots, without), (_, with_kept) = (
        runner_setup.state_split(cuda, plain),
        runner_setup.state_split(cuda, ngram),
    )
    assert slots == 8
    kept = 4 * ngram.num_speculative_tokens  # the ngram proposer's default rows
    assert without - with_kept == pytest.approx(kept * 1000 / 10**9)
