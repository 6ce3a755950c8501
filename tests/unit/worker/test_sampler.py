"""The batched sampler (worker/sampling/sampler.py): each transform, logprobs, seeds, batch independence."""

import itertools
import math

import pytest
import torch

from worker.sampling.sampler import (
    GrammarFailure,
    Sample,
    SequenceSampling,
    blocked_ids,
    sample_batch,
    uniform,
)
from worker.types import SamplingOptions

VOCAB = 50


def make(
    options: SamplingOptions, blocked: frozenset[int] = frozenset(), offset: int = 0
) -> SequenceSampling:
    return SequenceSampling(options, (1, 2, 3), blocked, seed_offset=offset)


def choose(sampling: SequenceSampling, logits: torch.Tensor) -> Sample:
    """One draw for one row (without recording it)."""
    return sample_batch(logits[None], [sampling])[0]


@pytest.fixture
def logits() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(VOCAB)


def draw(sampling: SequenceSampling, logits: torch.Tensor, steps: int = 20) -> list[int]:
    out = []
    for _ in range(steps):
        token = choose(sampling, logits).token_id
        sampling.record(token)
        out.append(token)
    return out


def test_temperature_zero_is_argmax(logits):
    token = choose(make(SamplingOptions(temperature=0)), logits).token_id
    assert token == int(torch.argmax(logits))


def test_same_seed_same_tokens_other_seed_other_tokens(logits):
    flat = logits / 10  # close to uniform, so different seeds differ
    a = draw(make(SamplingOptions(seed=7)), flat)
    b = draw(make(SamplingOptions(seed=7)), flat)
    c = draw(make(SamplingOptions(seed=8)), flat)
    assert a == b
    assert a != c


def test_choices_of_one_seeded_request_differ(logits):
    flat = logits / 10
    assert draw(make(SamplingOptions(seed=7), offset=0), flat) != draw(
        make(SamplingOptions(seed=7), offset=1), flat
    )


def test_top_k_one_and_tiny_top_p_pick_the_argmax(logits):
    best = int(torch.argmax(logits))
    assert set(draw(make(SamplingOptions(top_k=1, seed=1)), logits)) == {best}
    assert set(draw(make(SamplingOptions(top_p=1e-6, seed=1)), logits)) == {best}


def test_top_k_one_breaks_ties_as_argmax_does() -> None:
    """Tied best logits (a real model's near-ties round to equal floats): top_k 1 at any temperature
    picks the one greedy picks (the lowest id), so its text is the greedy text."""
    torch.manual_seed(0)
    tied = torch.randn(49152)  # a real vocabulary's size: torch's unstable sort reorders ties there
    tied[[3, 17, 41, 20000, 49000]] = 50.0
    for seed in range(20):
        options = SamplingOptions(top_k=1, temperature=1.0, seed=seed)
        assert choose(make(options), tied).token_id == int(torch.argmax(tied)) == 3


def test_top_k_restricts_to_the_k_best(logits):
    allowed = set(torch.topk(logits, 3).indices.tolist())
    assert set(draw(make(SamplingOptions(top_k=3, temperature=2.0, seed=3)), logits, 100)) <= allowed


def test_min_p_drops_unlikely_tokens(logits):
    probs = torch.softmax(logits, -1)
    allowed = {i for i, p in enumerate(probs.tolist()) if p >= 0.5 * probs.max()}
    assert set(draw(make(SamplingOptions(min_p=0.5, seed=3)), logits, 100)) <= allowed


def test_logit_bias_forces_and_bans(logits):
    assert set(draw(make(SamplingOptions(logit_bias=((5, 100.0),), seed=2)), logits)) == {5}
    best = int(torch.argmax(logits))
    token = choose(make(SamplingOptions(temperature=0, logit_bias=((best, -100.0),))), logits).token_id
    assert token != best


def test_min_tokens_masks_eos_until_reached():
    logits = torch.zeros(VOCAB)
    logits[0] = 50.0  # EOS would always win
    sampler = make(SamplingOptions(temperature=0, min_tokens=3), blocked=blocked_ids([0], SamplingOptions()))
    tokens = draw(sampler, logits, 4)
    assert 0 not in tokens[:3] and tokens[3] == 0


def test_presence_and_frequency_penalties_discourage_repeats():
    logits = torch.zeros(VOCAB)
    logits[4] = 1.0
    tokens = draw(make(SamplingOptions(temperature=0, frequency_penalty=2.0)), logits, 3)
    assert tokens[0] == 4 and tokens[1] != 4


def test_repetition_penalty_covers_the_prompt():
    logits = torch.zeros(VOCAB)
    logits[2] = 1.0  # token 2 is in the prompt (1, 2, 3)
    logits[9] = 0.9
    token = choose(make(SamplingOptions(temperature=0, repetition_penalty=1.5)), logits).token_id
    assert token == 9


def test_logprobs_are_the_raw_log_softmax_whatever_the_temperature(logits):
    reference = torch.log_softmax(logits, -1)
    for temperature in (0.0, 0.3, 1.7):
        sample = choose(make(SamplingOptions(temperature=temperature, top_p=0.5, logprobs=5, seed=1)), logits)
        entry = sample.logprobs
        assert entry is not None and entry.token_id == sample.token_id
        assert math.isclose(entry.logprob, float(reference[sample.token_id]), rel_tol=1e-5)
        assert len(entry.top_ids) == 5 and list(entry.top_logprobs) == sorted(
            entry.top_logprobs, reverse=True
        )
        assert math.isclose(entry.top_logprobs[0], float(reference.max()), rel_tol=1e-5)
        assert entry.top_ids[0] == int(reference.argmax())


def test_no_logprobs_unless_asked(logits):
    assert choose(make(SamplingOptions()), logits).logprobs is None


def test_rows_asking_different_numbers_of_alternatives_get_their_own(logits):
    rows = [make(SamplingOptions(temperature=0, logprobs=n)) for n in (0, 3, 1)] + [make(SamplingOptions())]
    samples = sample_batch(logits.repeat(4, 1), rows)
    assert [len(s.logprobs.top_ids) if s.logprobs else None for s in samples] == [0, 3, 1, None]


def test_batched_draw_follows_the_softmax_distribution():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    rows = [make(SamplingOptions(seed=s)) for s in range(4)]
    counts = torch.zeros(4)
    for _ in range(1500):
        for row, sample in zip(rows, sample_batch(logits.repeat(4, 1), rows), strict=True):
            counts[sample.token_id] += 1
            row.record(sample.token_id)
    freq = counts / counts.sum()
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.02), freq


def test_batched_choice_equals_row_by_row_choice(logits):
    rows = torch.stack([logits, logits * 0.5, logits * 2, logits.flip(0)])
    options = [
        SamplingOptions(seed=1),
        SamplingOptions(temperature=0),
        SamplingOptions(seed=2, top_p=0.8),
        SamplingOptions(seed=3, top_k=5, logprobs=2, presence_penalty=1.0, logit_bias=((4, 3.0),)),
    ]
    for _ in range(10):
        batched = [make(o) for o in options]
        alone = [make(o) for o in options]
        for step in range(8):
            together = sample_batch(rows, batched)
            apart = [sample_batch(row[None], [s])[0] for row, s in zip(rows, alone, strict=True)]
            assert together == apart, step
            for a, b, sample in zip(batched, alone, together, strict=True):
                a.record(sample.token_id)
                b.record(sample.token_id)


def test_the_uniform_stream_depends_only_on_seed_and_step():
    values = [uniform(seed, step) for seed in (0, 1, 2**62) for step in range(200)]
    assert all(0.0 <= v < 1.0 for v in values)
    assert len(set(values)) == len(values)
    assert uniform(7, 3) == uniform(7, 3) != uniform(7, 4)
    mean = sum(values) / len(values)
    assert abs(mean - 0.5) < 0.03


class _BrokenConstraint:
    mask_words = (VOCAB + 31) // 32
    finished = False

    def fill_mask(self, row: torch.Tensor) -> None:
        raise RuntimeError("matcher in error state")

    def advance(self, token_id: int) -> None:
        pass


def test_a_failing_grammar_fails_its_row_and_the_others_still_sample(logits):
    good = make(SamplingOptions(temperature=0))
    bad = make(SamplingOptions(temperature=0))
    bad.constraint = _BrokenConstraint()  # type: ignore[assignment]
    with pytest.raises(GrammarFailure) as caught:
        sample_batch(logits.repeat(2, 1), [good, bad])
    assert caught.value.rows == [1]
    assert caught.value.samples[0].token_id == int(logits.argmax())


def test_allowed_token_ids_are_the_only_candidates(logits):
    allowed = (3, 17, 41)
    tokens = draw(make(SamplingOptions(allowed_token_ids=allowed, temperature=2.0, seed=5)), logits, 100)
    assert set(tokens) <= set(allowed) and len(set(tokens)) > 1
    best = max(allowed, key=lambda t: float(logits[t]))
    assert choose(make(SamplingOptions(temperature=0, allowed_token_ids=allowed)), logits).token_id == best


def test_a_one_token_bad_word_is_never_drawn(logits):
    best = int(torch.argmax(logits))
    sampling = make(SamplingOptions(temperature=0, bad_words=((best,),)))
    assert best not in draw(sampling, logits, 5)


def test_a_longer_bad_word_bans_its_last_token_only_after_its_prefix():
    logits = torch.zeros(VOCAB)
    logits[7], logits[8] = 3.0, 2.0  # greedy: 7, then (frequency penalty) 8, then 7 again ...
    options = SamplingOptions(temperature=0, frequency_penalty=2.0, bad_words=((7, 8),))
    tokens = draw(make(options), logits, 6)
    assert tokens[0] == 7 and tokens[1] != 8  # 8 right after 7 would complete the word
    assert all((a, b) != (7, 8) for a, b in itertools.pairwise(tokens))
    plain = draw(make(SamplingOptions(temperature=0, frequency_penalty=2.0)), logits, 2)
    assert plain == [7, 8]  # without the bad word, the same logits do write it


def test_bad_words_and_allowed_ids_apply_per_row(logits):
    best = int(torch.argmax(logits))
    rows = [
        make(SamplingOptions(temperature=0, bad_words=((best,),))),
        make(SamplingOptions(temperature=0)),
        make(SamplingOptions(temperature=0, allowed_token_ids=(2, 4))),
    ]
    samples = sample_batch(logits.repeat(3, 1), rows)
    assert samples[0].token_id != best and samples[1].token_id == best
    assert samples[2].token_id in (2, 4)
