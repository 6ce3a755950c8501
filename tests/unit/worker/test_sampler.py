import math

import pytest
import torch

from worker.sampler import SequenceSampler, blocked_ids, choose_batch
from worker.types import SamplingOptions

VOCAB = 50


def info(token_id: int) -> tuple[str, bytes]:
    return f"t{token_id}", f"t{token_id}".encode()


def make(options: SamplingOptions, blocked: frozenset[int] = frozenset(), offset: int = 0) -> SequenceSampler:
    return SequenceSampler(options, (1, 2, 3), blocked, seed_offset=offset)


@pytest.fixture
def logits() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(VOCAB)


def draw(sampler: SequenceSampler, logits: torch.Tensor, steps: int = 20) -> list[int]:
    out = []
    for _ in range(steps):
        token, _ = sampler.choose(logits, info)
        sampler.record(token)
        out.append(token)
    return out


def test_temperature_zero_is_argmax(logits):
    token, _ = make(SamplingOptions(temperature=0)).choose(logits, info)
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
    token, _ = make(SamplingOptions(temperature=0, logit_bias=((best, -100.0),))).choose(logits, info)
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
    token, _ = make(SamplingOptions(temperature=0, repetition_penalty=1.5)).choose(logits, info)
    assert token == 9


def test_logprobs_are_the_raw_log_softmax_whatever_the_temperature(logits):
    reference = torch.log_softmax(logits, -1)
    for temperature in (0.0, 0.3, 1.7):
        sampler = make(SamplingOptions(temperature=temperature, top_p=0.5, logprobs=5, seed=1))
        token, entry = sampler.choose(logits, info)
        assert entry is not None and entry.token_id == token
        assert math.isclose(entry.logprob, float(reference[token]), rel_tol=1e-5)
        tops = [t.logprob for t in entry.top]
        assert len(tops) == 5 and tops == sorted(tops, reverse=True)
        assert math.isclose(tops[0], float(reference.max()), rel_tol=1e-5)
        assert entry.token == f"t{token}" and entry.token_bytes == f"t{token}".encode()


def test_no_logprobs_unless_asked(logits):
    assert make(SamplingOptions()).choose(logits, info)[1] is None


def test_batched_draw_follows_the_softmax_distribution():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    samplers = [make(SamplingOptions(seed=s)) for s in range(4)]
    counts = torch.zeros(4)
    for _ in range(1500):
        for token, _ in choose_batch(logits.repeat(4, 1), samplers, info):
            counts[token] += 1
    freq = counts / counts.sum()
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.02), freq


def test_batched_choice_equals_row_by_row_choice(logits):
    rows = torch.stack([logits, logits * 0.5, logits * 2, logits.flip(0)])
    options = [
        SamplingOptions(seed=1),
        SamplingOptions(temperature=0),
        SamplingOptions(seed=2, top_p=0.8),
        SamplingOptions(seed=3, top_k=5, logprobs=2),
    ]
    batched = choose_batch(rows, [make(o) for o in options], info)
    alone = [make(o).choose(row, info) for o, row in zip(options, rows, strict=True)]
    assert batched == alone
