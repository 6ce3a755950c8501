"""Speculation keeps every row's output exact, not only greedy ones: the acceptance rule against
exact distributions; 800 sampled continuations with and without it (chi-square, and equal
outputs for equal seeds); and rows with logprobs, penalties, min_tokens, bad_words, stop strings
and grammars equal their non-speculative reference while multi-token proposals are accepted."""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections import Counter, abc

import numpy as np
import pytest
import torch

from worker.engine.core import Engine
from worker.engine.options import EngineOptions
from worker.engine.speculation import RowSpeculation, Speculation
from worker.model.loader import load_model
from worker.model.runner import ModelRunner
from worker.sampling.grammar import GrammarCompiler, GrammarSpec
from worker.sampling.sampler import SequenceSampling, _draw_plain, _draw_sorted
from worker.server import eos_token_ids
from worker.types import ContentDelta, Finished, GenerationRequest, SamplingOptions

pytestmark = pytest.mark.slow  # left out of make test-fast

# ------------------------------------------------------------- the acceptance rule, exactly


def reference_probs(
    logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float
) -> np.ndarray:
    """The row's sampling distribution after temperature, top_k, top_p and min_p, from the
    definitions (top_p keeps the smallest likeliest prefix whose mass reaches it)."""
    scaled = np.exp((logits - logits.max()) / temperature)
    probs = scaled / scaled.sum()
    order = np.argsort(-probs, kind="stable")
    keep = np.zeros_like(probs, dtype=bool)
    mass = 0.0
    for rank, token in enumerate(order):
        if rank >= top_k or mass >= top_p:
            break
        keep[token] = True
        mass += probs[token] / probs[order[: min(top_k, len(order))]].sum()
    kept = np.where(keep, probs, 0.0)
    kept = np.where(kept >= min_p * kept.max(), kept, 0.0)
    return kept / kept.sum()


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "min_p"),
    [(1.0, 0, 1.0, 0.0), (0.7, 0, 1.0, 0.08), (1.3, 5, 1.0, 0.0), (0.9, 0, 0.8, 0.0), (0.8, 6, 0.9, 0.05)],
)
def test_accepting_a_proposal_when_the_draw_equals_it_is_speculative_sampling(
    temperature, top_k, top_p, min_p
):
    """The rule the engine verifies with: one uniform u per position, the row's own draw x(u),
    the proposal t accepted when x(u) == t, else x(u) is the row's token. Over a fine grid of u:
    P(accept) = p(t), and a rejection's token is distributed as max(0, p - q) renormalised, q the
    point mass on t: the standard algorithm for a deterministic draft, with the exact p."""
    logits = np.array([2.0, 1.5, 1.4, 0.3, 0.0, -0.5, -1.0, 2.2, 0.9, -3.0])
    vocab, grid = len(logits), 40_000
    probs = reference_probs(logits, temperature, top_k or vocab, top_p, min_p)
    params: dict[str, torch.Tensor | None] = {
        "temperature": torch.full((grid, 1), temperature),
        "top_k": torch.full((grid,), top_k or vocab, dtype=torch.long),
        "top_p": torch.full((grid,), top_p),
        "min_p": torch.full((grid,), min_p) if min_p else None,
    }
    u = (torch.arange(grid, dtype=torch.float64) + 0.5) / grid
    draw = _draw_sorted if top_k or top_p < 1 else _draw_plain
    drawn = draw(torch.tensor(logits, dtype=torch.float32).expand(grid, vocab), params, u).numpy()
    for proposal in range(vocab):
        accept = drawn == proposal
        assert accept.mean() == pytest.approx(probs[proposal], abs=2 * vocab / grid)
        if probs[proposal] > 0.999:
            continue
        residual = np.maximum(probs - np.eye(vocab)[proposal], 0.0)
        residual /= residual.sum()
        rejected = np.bincount(drawn[~accept], minlength=vocab) / max(1, (~accept).sum())
        np.testing.assert_allclose(rejected, residual, atol=2 * vocab / grid)


# ------------------------------------------------------------------- engines on the tiny model


class Scripted(Speculation):
    """Proposes, for each row, the continuation ``script`` holds for its prompt after as many tokens
    as the row generated (whatever the row actually drew: any deterministic draft will do); with
    ``noise``, one proposal of that share of steps is replaced by another token or by ``eos``."""

    def __init__(
        self, script: dict[tuple[int, ...], list[int]], noise: float = 0.0, eos: int = 0, tokens: int = 4
    ):
        super().__init__(tokens=tokens, min_n=1, max_n=3)
        object.__setattr__(self, "script", script)
        object.__setattr__(self, "noise", noise)
        object.__setattr__(self, "eos", eos)

    def guesses(
        self, sampling: SequenceSampling, acceptance: RowSpeculation, tokens: abc.Sequence[int], k: int
    ) -> list[int]:
        done = sampling.generated
        found = list(self.script.get(sampling.prompt_token_ids, [])[done : done + k])
        rng = random.Random(len(tokens) * 7919 + sampling.seed)
        if found and rng.random() < self.noise:
            found[rng.randrange(len(found))] = rng.choice([self.eos, rng.randrange(20, 2000)])
        return found


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(str(tiny_model_dir), device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def compiler(tiny):
    return GrammarCompiler(tiny.tokenizer, eos_token_ids(tiny.model, tiny.tokenizer))


def engine(loaded, speculation: Speculation | None, grammars: GrammarCompiler | None = None) -> Engine:
    eng = Engine(
        ModelRunner(loaded, num_blocks=1024, block_size=16),
        loaded.tokenizer,
        eos_token_ids=eos_token_ids(loaded.model, loaded.tokenizer),
        context_length=loaded.context_length,
        options=EngineOptions(max_running=128, max_queue=4096, prefill_budget_tokens=2048),
        grammars=grammars,
        speculation=speculation,
    )
    eng.start()
    return eng


def request(prompt: tuple[int, ...], grammar: str | None = None, **sampling) -> GenerationRequest:
    return GenerationRequest(
        f"r{random.random()}", prompt, SamplingOptions(**sampling), time.monotonic(), True, grammar=grammar
    )


Outcome = tuple[tuple[int, ...], str, str, list[tuple[int, float, tuple[int, ...], tuple[float, ...]]]]


def run(eng: Engine, requests: list[GenerationRequest]) -> list[Outcome]:
    """Each request's (single choice's) token ids, text, finish reason and logprob entries."""

    async def all_of() -> list[list]:
        async def one(req: GenerationRequest) -> list:
            return [event async for event in eng.submit(req)]

        return await asyncio.gather(*(one(r) for r in requests))

    outcomes = []
    for events in asyncio.run(all_of()):
        deltas = [e for e in events if isinstance(e, ContentDelta)]
        [end] = [e for e in events if isinstance(e, Finished)]
        entries = [
            (p.token_id, p.logprob, tuple(t.token_id for t in p.top), tuple(t.logprob for t in p.top))
            for d in deltas
            for p in d.logprobs
        ]
        ids = tuple(t for d in deltas for t in d.token_ids)
        outcomes.append((ids, "".join(d.text for d in deltas), str(end.reason), entries))
    return outcomes


def chi2_sf(statistic: float, df: int) -> float:
    """The chi-square distribution's survival function (closed forms of the regularised upper
    incomplete gamma function at integer and half-integer shapes)."""
    y = statistic / 2
    if df % 2 == 0:
        term = total = 1.0
        for i in range(1, df // 2):
            term *= y / i
            total += term
        return math.exp(-y) * total
    total = math.erfc(math.sqrt(y))
    term = math.sqrt(y) / math.gamma(1.5)
    for i in range(1, (df + 1) // 2):
        total += math.exp(-y) * term
        term *= y / (i + 1.5)
    return total


def test_chi2_sf_matches_known_values():
    assert chi2_sf(3.841458820694124, 1) == pytest.approx(0.05, rel=1e-9)
    assert chi2_sf(5.991464547107979, 2) == pytest.approx(0.05, rel=1e-9)
    assert chi2_sf(11.344866730144373, 3) == pytest.approx(0.01, rel=1e-9)
    assert chi2_sf(23.209251158954356, 10) == pytest.approx(0.01, rel=1e-9)


def homogeneity_p(first: Counter, second: Counter) -> float:
    """Two samples' chi-square test of one distribution; categories expected fewer than 5 times
    in either sample are pooled into one."""
    n1, n2 = sum(first.values()), sum(second.values())
    keys = sorted(set(first) | set(second), key=lambda k: -(first[k] + second[k]))
    small = [k for k in keys if (first[k] + second[k]) * min(n1, n2) / (n1 + n2) < 5]
    table = [(first[k], second[k]) for k in keys if k not in small]
    if small:
        table.append((sum(first[k] for k in small), sum(second[k] for k in small)))
    statistic = 0.0
    for a, b in table:
        total = a + b
        for observed, n in ((a, n1), (b, n2)):
            expected = total * n / (n1 + n2)
            statistic += (observed - expected) ** 2 / expected
    return chi2_sf(statistic, len(table) - 1)


PROMPT = "Once upon a time, in a small village by the sea, there lived"
# Per sampler setting and run: 800 continuations a run. Ten chi-square tests at p > 0.001 each fail
# a correct engine at most once in a hundred seed ranges whatever the count (at p > 0.01 each, with
# 1,000 draws, it was up to one in ten); the count sets the power: two samples of 400 detect a
# distance (the sum of (p - q)^2 over their mean) of 0.15 nine times in ten (up to 6 degrees of
# freedom), and a rejection redrawn from the row's distribution (the classic mistake) moves each
# verified position by 0.14 to 0.25 here. Equal seeds' equal tokens check each draw exactly.
DRAWS = 400
# The tiny model's random logits are nearly flat over 49,152 tokens; a bias on seven tokens (and
# min_p) gives each position a distribution of a few tokens, still shifted by the model's logits.
BIAS = tuple((100 + i, 2.0 - 0.15 * i) for i in range(7))
SETTINGS = ({"temperature": 0.25, "min_p": 0.02}, {"temperature": 0.5, "min_p": 0.1})


def test_sampled_continuations_keep_their_distribution_and_seeded_ones_their_tokens(tiny):
    """Two sampler settings, 400 four-token continuations each, seeded: without speculation
    (seeds 0..399) and with it (seeds 400..799): a chi-square test of each position's token and
    of pairs of positions, p > 0.001. With equal seeds (0..99) the tokens are the same. The
    proposals are fixed guesses (the likeliest token, sometimes others): accepted and rejected."""
    prompt = tuple(tiny.tokenizer.encode(PROMPT))

    def batch(first_seed: int, draws: int) -> list[GenerationRequest]:
        return [
            request(prompt, **options, logit_bias=BIAS, seed=first_seed + i, max_tokens=4, ignore_eos=True)
            for options in SETTINGS
            for i in range(draws)
        ]

    plain = engine(tiny, None)
    try:
        reference = run(plain, batch(0, DRAWS))
    finally:
        plain.stop()
    fast = engine(tiny, Scripted({prompt: [100, 100, 100, 101, 100]}, noise=0.2))
    try:
        same_seeds = run(fast, batch(0, 100))
        other = run(fast, batch(DRAWS, DRAWS))
        counters = fast.stats().counters
    finally:
        fast.stop()
    assert same_seeds == reference[:100] + reference[DRAWS : DRAWS + 100]
    assert 0 < counters.speculative_accepted_tokens < counters.speculative_proposed_tokens
    for part, options in enumerate(SETTINGS):
        mine = [ids for ids, _, _, _ in reference[part * DRAWS : (part + 1) * DRAWS]]
        theirs = [ids for ids, _, _, _ in other[part * DRAWS : (part + 1) * DRAWS]]
        for key in ((1,), (2,), (3,), (1, 2), (2, 3)):
            first = Counter(tuple(ids[k] for k in key) for ids in mine)
            assert len(first) >= 4 and max(first.values()) < 0.9 * DRAWS  # a real distribution
            p = homogeneity_p(first, Counter(tuple(ids[k] for k in key) for ids in theirs))
            assert p > 0.001, (options, key, p)


# ------------------------------------------------------------------- every sampling feature


def feature_requests(loaded, compiler: GrammarCompiler) -> list[GenerationRequest]:
    """Prompts of their own, each exercising one feature (seeded where sampled)."""
    words = [
        "Once upon a time",
        "The river rose",
        "In the morning",
        "A small village",
        "By the sea",
        "He said",
    ]
    prompts = [tuple(loaded.tokenizer.encode(f"{w}, {i}")) for i, w in enumerate(words * 3)]
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    grammar = compiler.validate(GrammarSpec("json_schema", schema=schema))
    regex = compiler.validate(GrammarSpec("regex", text="[a-z ]{4,40}\\."))
    long = {"max_tokens": 24, "ignore_eos": True}
    eos = loaded.tokenizer.eos_token_id
    return [
        request(prompts[0], temperature=0.0, logprobs=3, **long),
        request(prompts[1], temperature=0.9, seed=11, logprobs=2, **long),
        request(prompts[2], temperature=0.0, repetition_penalty=1.3, **long),
        request(prompts[3], temperature=0.7, seed=5, presence_penalty=0.8, frequency_penalty=0.6, **long),
        request(prompts[4], temperature=0.0, frequency_penalty=1.5, logprobs=1, **long),
        # End-of-sequence made likely: held back until min_tokens, then (nearly) certain or likely.
        request(prompts[5], temperature=0.0, min_tokens=7, max_tokens=24, logit_bias=((eos, 12.0),)),
        request(prompts[6], temperature=1.0, seed=3, min_tokens=5, max_tokens=24, logit_bias=((eos, 10.0),)),
        request(prompts[7], temperature=0.0, bad_words=((prompts[7][-1],),), **long),
        request(prompts[8], temperature=0.0, logit_bias=((100, 5.0), (200, 3.0)), **long),
        request(prompts[9], temperature=0.0, allowed_token_ids=tuple(range(20, 400)), **long),
        request(prompts[10], grammar, temperature=0.0, max_tokens=40),
        request(prompts[11], grammar, temperature=0.9, seed=8, max_tokens=40),
        request(prompts[12], regex, temperature=0.8, seed=2, max_tokens=40),
        request(prompts[13], temperature=0.0, **long),  # its stop string is chosen from its text
        request(prompts[14], temperature=0.6, seed=4, top_k=20, **long),
        request(prompts[15], temperature=0.0, speculative=False, **long),
    ]


def with_stop(requests: list[GenerationRequest], texts: list[str]) -> list[GenerationRequest]:
    """The stop-string request with a stop string from the middle of its reference text."""
    out = list(requests)
    text = texts[13]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip()
    out[13] = request(out[13].prompt_token_ids, temperature=0.0, max_tokens=24, ignore_eos=True, stop=(stop,))
    return out


def same(expected: list[Outcome], got: list[Outcome]) -> None:
    """Equal tokens, texts and finish reasons; logprobs equal up to float rounding (a verified
    chunk's logits are computed together, a decode step's alone)."""
    for want, have in zip(expected, got, strict=True):
        assert have[:3] == want[:3]
        assert [(e[0], e[2]) for e in have[3]] == [(e[0], e[2]) for e in want[3]]
        np.testing.assert_allclose([e[1] for e in have[3]], [e[1] for e in want[3]], atol=1e-4)
        np.testing.assert_allclose(
            [v for e in have[3] for v in e[3]], [v for e in want[3] for v in e[3]], atol=1e-4
        )


def test_rows_with_every_feature_equal_their_reference_while_proposals_are_accepted(tiny, compiler):
    """Proposals are each row's reference continuation (all accepted, several per step) and, in a
    second engine, the same with noise (rejections anywhere): every row equals its reference."""
    plain = engine(tiny, None, compiler)
    try:
        base = feature_requests(tiny, compiler)
        texts = [text for _, text, _, _ in run(plain, base)]
        requests = with_stop(base, texts)
        reference = run(plain, requests)
    finally:
        plain.stop()
    assert reference[13][2] == "FinishReason.STOP" and len(reference[13][0]) < 24
    assert reference[5][2] == "FinishReason.STOP" and len(reference[5][0]) == 7
    assert reference[6][2] == "FinishReason.STOP" and 5 <= len(reference[6][0]) < 24
    assert all(len(entries) == len(ids) for ids, _, _, entries in (reference[i] for i in (0, 1, 4)))
    script = {req.prompt_token_ids: list(out[0]) for req, out in zip(requests, reference, strict=True)}
    for noise in (0.0, 0.5):
        fast = engine(tiny, Scripted(script, noise=noise, eos=tiny.tokenizer.eos_token_id), compiler)
        try:
            same(reference, run(fast, requests))
            counters = fast.stats().counters
        finally:
            fast.stop()
        assert counters.speculative_accepted_tokens > 0
        if noise == 0.0:  # the scripts are right: every proposal but those past a stop is taken
            assert counters.speculative_accepted_tokens >= 0.8 * counters.speculative_proposed_tokens
        assert counters.steps < sum(len(ids) for ids, _, _, _ in reference)


def test_a_grammar_rows_proposals_stop_before_the_first_token_its_grammar_forbids(tiny, compiler):
    tokenizer = tiny.tokenizer
    word, digits = tokenizer.encode("hello"), tokenizer.encode("123")
    guesses = [*word, *digits]

    class Fixed(Speculation):
        def guesses(self, sampling, acceptance, tokens, k):  # type: ignore[no-untyped-def]
            return guesses[:k]

    fixed = Fixed(tokens=8, min_n=1, max_n=3)
    for pattern, kept in (("[a-z]+", word), ("[a-z]+[0-9]+", guesses), ("[0-9]+", [])):
        constraint = compiler.constraint(compiler.validate(GrammarSpec("regex", text=pattern)))
        sampling = SequenceSampling(SamplingOptions(), (1, 2), frozenset(), constraint=constraint)
        assert fixed.proposals(sampling, RowSpeculation(), [1, 2], 8) == kept, pattern
        assert constraint.allowed_prefix(guesses) == len(kept) and sampling.generated == 0
    assert fixed.proposals(SequenceSampling(SamplingOptions(), (1,), frozenset()), RowSpeculation(), [1], 8)
