"""Speculative decoding on hybrid models (worker/model/verify_states.py): a verifying row's tokens
go through the recurrent mixers in sequence, and once its draws are known the slot takes the state
at the accepted length. The runner against transformers' eager forward (Gated DeltaNet, Mamba-2,
short convolutions), and engines with and without speculation on a tiny Qwen3.5 and Granite 4
hybrid with a real tokenizer: the same greedy and seeded tokens, with acceptances and rejections."""

from __future__ import annotations

import random
from collections import abc
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.tiny_families import eager_reference, save_tiny, tiny_config, tiny_model
from tests.unit.worker.test_engine import request as generation
from tests.unit.worker.test_hybrid_families import ATOL
from tests.unit.worker.test_model_families import BLOCK, VOCAB, loaded
from tests.unit.worker.test_speculation import engine, prompts, run_batch
from worker.config import parse_config
from worker.engine.speculation import RowSpeculation, Speculation
from worker.model.draft import DraftModel
from worker.model.loader import load_model
from worker.model.runner import ModelRunner
from worker.model.step_inputs import Work
from worker.sampling.sampler import SequenceSampling
from worker.server import speculation_of

pytestmark = pytest.mark.slow  # left out of make test-fast


class Row:
    """One sequence on the runner: its tokens, how many are computed, its blocks and state slot."""

    def __init__(self, tokens: list[int], slot: int):
        self.tokens = tokens
        self.slot = slot
        self.table = [slot * 10 + i for i in range(10)]
        self.computed = 0

    def work(self, proposals: tuple[int, ...] = ()) -> Work:
        """The rest of its known tokens, then ``proposals`` to verify."""
        tokens = [*self.tokens[self.computed :], *proposals]
        return Work(tokens, self.computed, self.table, True, proposed=len(proposals), state_slot=self.slot)


def eager(reference, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return reference(input_ids=torch.tensor([tokens])).logits[0]


def verify_step(
    runner: ModelRunner,
    reference,
    rows: list[Row],
    proposals: list[tuple[int, ...]],
    kept: list[int],
    atol: float,
) -> None:
    """One step of ``rows`` verifying ``proposals`` (each row's logits equal eager's over its
    tokens and proposals), then each keeps its first ``kept``: its known tokens grow by them and
    one new token."""
    items = [row.work(p) for row, p in zip(rows, proposals, strict=True)]
    logits = runner.execute(items)
    first = 0
    for row, item, taken in zip(rows, items, kept, strict=True):
        want = eager(reference, [*row.tokens, *item.proposals])[-(1 + item.proposed) :]
        torch.testing.assert_close(logits[first : first + 1 + item.proposed], want, atol=atol, rtol=1e-4)
        first += 1 + item.proposed
        if item.proposed:
            runner.accepted(item, taken)
        row.tokens += [*item.proposals[:taken], (len(row.tokens) * 29 + 5) % VOCAB]
        row.computed = item.start + item.count + taken


@pytest.mark.parametrize("family", ["qwen3_5_text", "granitemoehybrid", "lfm2"])
def test_verifying_rows_score_in_sequence_and_keep_the_state_at_the_accepted_length(family: str) -> None:
    """Prompts, then verifying rows beside a plain decode row and a prompt chunk (the flat path),
    then verifying rows alone (the ``[rows, 1]`` path) with every acceptance (none, some, all), then
    plain decode rows: every logit equals eager's over the tokens kept."""
    model = tiny_model(tiny_config(family))
    reference = eager_reference(model)
    atol = ATOL.get(family, 1e-3)
    runner = ModelRunner(loaded(model), num_blocks=64, block_size=BLOCK, max_sequences=4)
    a, b, c = (
        Row([(seed + 7 * i) % VOCAB for i in range(11 + seed)], slot) for slot, seed in enumerate((1, 2, 3))
    )
    d = Row([(9 * i + 4) % VOCAB for i in range(13)], 3)
    verify_step(runner, reference, [a, b, c], [(), (), ()], [0, 0, 0], atol)
    verify_step(runner, reference, [a, b, c, d], [(5, 6, 7), (8, 9), (), ()], [1, 0, 0, 0], atol)
    verify_step(runner, reference, [a, b, c, d], [(3, 4, 5), (1,), (2, 7, 9, 11), (6, 6)], [3, 1, 2, 0], atol)
    verify_step(runner, reference, [a, b, c, d], [(), (), (), ()], [0, 0, 0, 0], atol)


def test_speculation_is_served_for_a_hybrid_target() -> None:
    """A hybrid target verifies like any other (a hybrid draft stays refused: test_speculation)."""
    hybrid = SimpleNamespace(device=torch.device("cpu"), model=tiny_model(tiny_config("lfm2")))
    speculation = speculation_of(parse_config(["--speculative", "ngram"]), hybrid)  # type: ignore[arg-type]
    assert speculation is not None and speculation.proposer == "ngram"


@pytest.fixture(scope="module")
def qwen3_5(tiny_hybrid_dir):
    return load_model(str(tiny_hybrid_dir), device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def granite4(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path):
    """A tiny random Granite 4 hybrid (Mamba-2 and attention layers) with the default tokenizer."""
    folder = save_tiny(
        tmp_path_factory.mktemp("tiny-granite4"),
        "granitemoehybrid",
        default_model_dir,
        hidden_size=32,
        intermediate_size=32,
        mamba_d_head=8,
        tie_word_embeddings=True,
    )
    return load_model(str(folder), device="cpu", dtype="float32")


@dataclass(frozen=True)
class Oracle(Speculation):
    """Proposes what the engine without speculation generated (``answers``: prompt -> tokens),
    one proposal of every other step made wrong: a random tiny model rarely loops, so lookup alone
    would propose little; this accepts runs and rejects at every place."""

    answers: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...] = ()

    def guesses(
        self, sampling: SequenceSampling, acceptance: RowSpeculation, tokens: abc.Sequence[int], k: int
    ) -> list[int]:
        for prompt, answer in self.answers:
            if tuple(tokens[: len(prompt)]) == prompt:
                found = list(answer[len(tokens) - len(prompt) :][:k])
                rng = random.Random(len(tokens))
                if found and rng.random() < 0.5:
                    found[rng.randrange(len(found))] += 1
                return found
        return []


@pytest.mark.parametrize("family", ["qwen3_5", "granite4"])
def test_greedy_and_seeded_tokens_are_the_same_with_speculation(
    family: str, request: pytest.FixtureRequest
) -> None:
    """Greedy rows and one seeded sampled row beside each other: the same outcomes with proposals
    as without, some accepted and some rejected, and every block free afterwards."""
    model = request.getfixturevalue(family)
    base = prompts(4, 11)
    batch = [generation(p, temperature=0.0, max_tokens=20, ignore_eos=True) for p in base[:3]]
    batch.append(generation(base[3], temperature=0.8, seed=7, max_tokens=12, ignore_eos=True))
    plain = engine(model, speculation=None)
    try:
        expected = run_batch(plain, batch)
    finally:
        plain.stop()
    answers = tuple(
        (req.prompt_token_ids, ids) for req, [(_, ids, _, _)] in zip(batch, expected, strict=True)
    )
    fast = engine(model, speculation=Oracle(tokens=4, min_n=1, max_n=3, answers=answers))
    try:
        assert run_batch(fast, batch) == expected
        stats = fast.stats()
    finally:
        fast.stop()
    counters = stats.counters
    assert 0 < counters.speculative_accepted_tokens < counters.speculative_proposed_tokens
    assert stats.kv_blocks_used == 0 and stats.running_sequences == 0


def test_an_attention_draft_model_proposes_for_a_hybrid_target(qwen3_5, tiny_model_dir) -> None:
    """``--speculative draft`` with the tiny Llama (same tokenizer) drafting for the tiny Qwen3.5:
    the same greedy tokens as without, its proposals verified."""
    drafting = load_model(str(tiny_model_dir), device="cpu", dtype="float32")
    batch = [generation(p, temperature=0.0, max_tokens=12, ignore_eos=True) for p in prompts(2, 13)]
    plain, fast = (
        engine(qwen3_5, speculation=None),
        engine(
            qwen3_5, speculation=Speculation(tokens=3, min_n=1, max_n=3, draft=DraftModel(drafting, qwen3_5))
        ),
    )
    try:
        assert run_batch(fast, batch) == run_batch(plain, batch)
        assert fast.stats().counters.speculative_proposed_tokens > 0
    finally:
        plain.stop()
        fast.stop()
