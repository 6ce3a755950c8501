"""Speculative decoding (--speculative ngram) is lossless: greedy outputs with it equal outputs
without it, token for token, on the tiny model and the default model (float32; int4 with
--batch-invariant), engines in-process, and the KV block accounting is exact afterwards; plus the
proposer, the acceptance rule, eligibility and the settings."""

from __future__ import annotations

import asyncio
import random
from collections import abc
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch

from tests.tiny_families import tiny_config, tiny_model
from tests.unit.worker.test_engine import request
from worker.config import DEFAULT_MAX_ROWS, parse_config
from worker.engine.core import Engine
from worker.engine.kv_blocks import BlockManager
from worker.engine.options import EngineOptions
from worker.engine.scheduler import Scheduler, SeqState
from worker.engine.speculation import PAUSE_TOKENS, WINDOW_TOKENS, RowSpeculation, Speculation
from worker.model.draft import DraftCache, DraftModel
from worker.model.loader import ModelLoadError, load_model
from worker.model.runner import ModelRunner
from worker.sampling.ngram import propose
from worker.sampling.sampler import SequenceSampling
from worker.server import draft_quantization, eos_token_ids, speculation_of
from worker.types import ContentDelta, Finished, GenerationRequest, SamplingOptions, Scheduling

pytestmark = pytest.mark.slow  # left out of make test-fast

SPECULATION = Speculation(tokens=4, min_n=1, max_n=3)


class NoisyLookup(Speculation):
    """The n-gram lookup with one proposal of most steps replaced by a random token: the tiny
    model's loops make lookups nearly always right, so this puts the first rejection anywhere."""

    def guesses(
        self, sampling: SequenceSampling, acceptance: RowSpeculation, tokens: abc.Sequence[int], k: int
    ) -> list[int]:
        found = super().guesses(sampling, acceptance, tokens, k)
        rng = random.Random(len(tokens) * 7919 + sum(tokens[-4:]))
        if found and rng.random() < 0.7:
            found[rng.randrange(len(found))] = rng.randrange(3, 2000)
        return found


NOISY = NoisyLookup(tokens=6, min_n=1, max_n=3)

# ------------------------------------------------------------------ pure parts


def test_the_proposer_takes_the_longest_latest_suffix_match():
    assert propose([1, 2, 3, 4, 5, 1, 2, 3], min_n=1, max_n=3, k=4) == [4, 5, 1, 2]
    # "2 3" matched at two places: the latest wins; "9 2 3" never occurred, so a 3-token minimum fails.
    assert propose([2, 3, 7, 2, 3, 8, 9, 2, 3], min_n=1, max_n=3, k=2) == [8, 9]
    assert propose([1, 2, 3, 4, 9, 2, 3], min_n=3, max_n=3, k=4) == []
    # A longer match beats a later shorter one.
    assert propose([5, 2, 3, 6, 7, 3, 8, 5, 2, 3], min_n=1, max_n=3, k=1) == [6]
    assert propose([1, 2, 3], min_n=1, max_n=3, k=4) == []
    assert propose([4, 1, 4], min_n=1, max_n=3, k=0) == []
    assert propose([7, 7, 7], min_n=1, max_n=3, k=4) == [7]  # only what followed


def _sampling(**options) -> SequenceSampling:
    return SequenceSampling(SamplingOptions(**options), (1, 2), frozenset({0}))


def test_every_row_proposes_unless_its_request_turned_speculation_off():
    tokens = [5, 6, 7, 5, 6]
    for options in ({"temperature": 0.0}, {"temperature": 0.8, "top_p": 0.9, "logprobs": 2, "min_tokens": 4}):
        assert SPECULATION.proposals(_sampling(**options), RowSpeculation(), tokens, 8) == [7, 5, 6]
    assert SPECULATION.proposals(_sampling(speculative=False), RowSpeculation(), tokens, 8) == []
    assert SPECULATION.proposals(_sampling(), RowSpeculation(), tokens, 2) == [7, 5]  # the room


def test_a_row_whose_proposals_keep_failing_pauses_then_tries_again():
    adaptive = Speculation(tokens=4, min_n=1, max_n=3, min_acceptance=0.25)
    row, sampling, tokens = RowSpeculation(), _sampling(), [5, 6, 7, 5, 6]
    for step in range(3):  # 12 proposals, 3 accepted: the window is not full yet
        adaptive.observe(row, 4, 1, generated=step + 1)
        assert row.rate is None and adaptive.proposals(sampling, row, tokens, 8)
    adaptive.observe(row, 4, 0, generated=4)  # 16 proposals, 3 accepted: below a quarter
    assert row.paused_until == 4 + PAUSE_TOKENS and not row.steps
    sampling.output_token_ids[:] = [9] * (PAUSE_TOKENS + 3)
    assert adaptive.proposals(sampling, row, tokens, 8) == []
    sampling.output_token_ids.append(9)
    assert adaptive.proposals(sampling, row, tokens, 8) == [7, 5, 6]
    # A good row keeps a window of its latest steps and never pauses.
    good = RowSpeculation()
    for step in range(40):
        adaptive.observe(good, 4, 3 if step % 2 else 1, generated=step)
        assert good.paused_until == 0
    assert sum(p for p, _ in good.steps) - good.steps[0][0] < WINDOW_TOKENS <= sum(p for p, _ in good.steps)
    assert good.rate == pytest.approx(0.5)
    # 0 never pauses.
    never, never_row = Speculation(tokens=4, min_n=1, max_n=3), RowSpeculation()
    for step in range(10):
        never.observe(never_row, 4, 0, generated=step)
        assert never_row.paused_until == 0


@dataclass
class _Item:
    request_id: str
    sequences: list[SeqState]
    needs_kv: bool = True
    scheduling: Scheduling = field(default_factory=Scheduling)


def test_proposals_count_against_the_budget_and_their_blocks_go_back():
    blocks = BlockManager(8, 4, prefix_caching=False)
    seq = SeqState([1, 2, 3, 1, 2, 3], 5, 40)
    seq.blocks.table = [blocks.allocate(), blocks.allocate()]  # 5 tokens computed, the 6th pending
    seq.computed = 5
    scheduler: Scheduler[_Item] = Scheduler(
        blocks, max_running=4, max_queue=4, prefill_budget_tokens=4, propose=lambda item, s, room: [9] * room
    )
    scheduler.running.append(_Item("a", [seq]))
    plan = scheduler.schedule()
    [work] = plan.work
    assert work.count == 1 and work.proposals == (9, 9, 9)  # the budget of 4 holds the row's own token too
    assert len(seq.blocks.table) == 3  # slots 5..8
    seq.tokens += [9, 4]  # one proposal accepted, then the model's own token
    scheduler.committed(work, accepted=1)
    assert seq.computed == 7 and len(seq.blocks.table) == 2 and blocks.used == 2


def test_steps_with_more_decoding_rows_than_the_limit_do_not_speculate():
    """--speculative-max-rows: a large batch gets no proposals (verified tokens would cost it more
    than they save); at the limit every row still gets its proposals."""
    for rows, speculated in ((4, True), (5, False)):
        blocks = BlockManager(64, 4, prefix_caching=False)
        scheduler: Scheduler[_Item] = Scheduler(
            blocks,
            max_running=8,
            max_queue=8,
            prefill_budget_tokens=64,
            propose=lambda item, s, room: [9, 9],
            speculate_max_rows=4,
        )
        for row in range(rows):
            seq = SeqState([1, 2, 3, 1, 2, 3], 5, 40)
            seq.blocks.table = [blocks.allocate(), blocks.allocate()]
            seq.computed = 5
            scheduler.running.append(_Item(str(row), [seq]))
        plan = scheduler.schedule()
        assert len(plan.work) == rows
        assert all(work.proposals == ((9, 9) if speculated else ()) for work in plan.work), rows


def test_speculation_is_off_by_default_and_runs_on_any_device():
    assert parse_config([]).speculative == "off"
    config = parse_config(["--speculative", "ngram", "--num-speculative-tokens", "5", "--ngram-min", "2"])
    llama = tiny_model(tiny_config("llama"))
    cpu = SimpleNamespace(device=torch.device("cpu"), model=llama)
    assert speculation_of(config, cpu) == Speculation(5, 2, 3, 4, 0.2)  # type: ignore[arg-type]
    limited = parse_config(["--speculative", "ngram", "--speculative-max-rows", "2"])
    assert speculation_of(limited, cpu).max_rows == 2  # type: ignore[arg-type, union-attr]
    assert speculation_of(parse_config([]), cpu) is None  # type: ignore[arg-type]
    # verifying rows are decode rows on CUDA too
    cuda = SimpleNamespace(device=torch.device("cuda"), model=llama)
    assert speculation_of(config, cuda) == Speculation(5, 2, 3, 4, 0.2)  # type: ignore[arg-type]
    with pytest.raises(SystemExit):
        parse_config(["--ngram-min", "4", "--ngram-max", "2"])


def test_a_hybrid_draft_model_is_refused():
    vocab = SimpleNamespace(get_vocab=lambda: {"a": 0})
    draft = SimpleNamespace(model=tiny_model(tiny_config("lfm2")), model_id="tiny-lfm2", tokenizer=vocab)
    with pytest.raises(
        ModelLoadError, match=r"draft model tiny-lfm2 \(lfm2\) has recurrent layers"
    ) as raised:
        DraftModel(draft, draft)  # type: ignore[arg-type]
    assert raised.value.param == "draft_model"


# ------------------------------------------------------------------ engines


def engine(
    loaded,
    *,
    speculation: Speculation | None,
    pool_tokens: int = 4096,
    block_size: int = 16,
    batch_invariant: bool = False,
    kv_cache_dtype: str = "auto",
    **options,
):
    settings = {"max_running": 4, "max_queue": 100, "prefill_budget_tokens": 64, "prefix_caching": True}
    eng = Engine(
        ModelRunner(
            loaded,
            num_blocks=pool_tokens // block_size,
            block_size=block_size,
            batch_invariant=batch_invariant,
            kv_cache_dtype=kv_cache_dtype,
        ),
        loaded.tokenizer,
        eos_token_ids=eos_token_ids(loaded.model, loaded.tokenizer),
        context_length=loaded.context_length,
        speculation=speculation,
        options=EngineOptions(**{**settings, **options}),
    )
    eng.start()
    return eng


def outcome(events: list) -> list[tuple[int, tuple[int, ...], str, str]]:
    """Each choice's token ids, text and finish reason."""
    choices = sorted({e.choice_index for e in events if isinstance(e, ContentDelta | Finished)})
    result = []
    for index in choices:
        deltas = [e for e in events if isinstance(e, ContentDelta) and e.choice_index == index]
        [end] = [e for e in events if isinstance(e, Finished) and e.choice_index == index]
        ids = tuple(t for d in deltas for t in d.token_ids)
        result.append((index, ids, "".join(d.text for d in deltas), str(end.reason)))
    return result


def run_batch(eng: Engine, requests: list[GenerationRequest]) -> list:
    async def all_of() -> list:
        async def one(req: GenerationRequest) -> list:
            return [event async for event in eng.submit(req)]

        return await asyncio.gather(*(one(r) for r in requests))

    return [outcome(events) for events in asyncio.run(all_of())]


def compare(
    loaded,
    batches: list[list[GenerationRequest]],
    speculation: Speculation | abc.Sequence[Speculation] = SPECULATION,
    **options,
) -> list[Engine]:
    """Runs each batch on an engine without speculation and on one engine per speculation: equal
    outcomes, and every pool fully free afterwards. The plain run is the one reference of all the
    speculating engines (it costs as much as each of them). Returns the speculating engines
    (stopped), in order, for their counters."""
    speculations = [speculation] if isinstance(speculation, Speculation) else list(speculation)
    plain = engine(loaded, speculation=None, **options)
    fast = [engine(loaded, speculation=s, **options) for s in speculations]
    try:
        for batch in batches:
            expected = run_batch(plain, batch)
            assert all(expected), "every request finished"
            for eng in fast:
                assert run_batch(eng, batch) == expected
            for eng in (plain, *fast):
                assert eng.stats().kv_blocks_used == 0
                assert eng.stats().running_sequences == 0
    finally:
        for eng in (plain, *fast):
            eng.stop()
    return fast


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(str(tiny_model_dir), device="cpu", dtype="float32")


def prompts(count: int, seed: int) -> list[list[int]]:
    """Random prompts, half of them repeating a phrase (what lookup finds at once)."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        phrase = [rng.randrange(3, 2000) for _ in range(rng.randrange(3, 12))]
        out.append(phrase * 3 if i % 2 else phrase + [rng.randrange(3, 2000) for _ in range(9)])
    return out


def test_greedy_single_requests_are_unchanged(tiny):
    batches = [[request(p, temperature=0.0, max_tokens=48)] for p in prompts(4, 1)]
    batches.append([request(prompts(1, 2)[0], temperature=0.0, max_tokens=48, ignore_eos=True)])
    [fast] = compare(tiny, batches)
    counters = fast.stats().counters
    assert counters.speculative_accepted_tokens > 0  # the tiny model loops: lookup finds its loops
    assert counters.speculative_proposed_tokens >= counters.speculative_accepted_tokens


def test_mixed_batches_with_stops_cuts_n_and_sampled_rows_are_unchanged(tiny):
    base = prompts(6, 3)
    reference = engine(tiny, speculation=None)
    try:
        [[(_, _, text, _)]] = run_batch(reference, [request(base[1], temperature=0.0, max_tokens=40)])
    finally:
        reference.stop()
    stop = text[len(text) // 2 : len(text) // 2 + 3]  # a stop string inside the greedy text
    batch = [
        request(base[0], temperature=0.0, max_tokens=30),
        request(base[1], temperature=0.0, max_tokens=40, stop=(stop,)),
        request(base[2], temperature=0.8, seed=7, max_tokens=20),  # sampled rows decode as before
        request(base[3], temperature=0.0, max_tokens=24, n=2),
        request(base[4], temperature=0.0, max_tokens=24, logprobs=2),  # not eligible
    ]
    # max_tokens cut at every length within the first accepted runs.
    cuts = [request(base[5], temperature=0.0, max_tokens=m, ignore_eos=True) for m in (1, 2, 3, 5, 7, 11)]
    again = [
        request(base[0], temperature=0.0, max_tokens=30),
        request(base[3], temperature=0.0, max_tokens=24),
    ]
    # "again": prefix-cache hits; one plain run is the reference of both lookups.
    engines = compare(tiny, [batch, cuts, again], (SPECULATION, NOISY), max_running=8)
    for fast in engines:
        assert fast.stats().counters.speculative_accepted_tokens > 0
    counters = engines[-1].stats().counters  # NOISY's
    assert counters.speculative_accepted_tokens < counters.speculative_proposed_tokens  # rejections


def test_preemption_on_a_tiny_pool_leaves_outputs_and_blocks_exact(tiny):
    batch = [request(p, temperature=0.0, max_tokens=40, ignore_eos=True) for p in prompts(4, 5)]
    for fast in compare(tiny, [batch], (SPECULATION, NOISY), pool_tokens=96, block_size=4):
        counters = fast.stats().counters
        assert counters.preemptions > 0 and counters.speculative_accepted_tokens > 0


def test_an_int8_cache_under_preemption_prefix_hits_and_speculation_stays_exact(tiny):
    """--kv-cache-dtype int8 (test_kv_quant.py): verifying rows, recomputed preempted requests and
    prefix-cache hits read the codes as one-token steps do; no block is left held."""
    batch = [request(p, temperature=0.0, max_tokens=40, ignore_eos=True) for p in prompts(4, 5)]
    [fast] = compare(tiny, [batch], SPECULATION, pool_tokens=96, block_size=4, kv_cache_dtype="int8")
    counters = fast.stats().counters
    assert counters.preemptions > 0 and counters.speculative_accepted_tokens > 0
    again = [request(p, temperature=0.0, max_tokens=12, ignore_eos=True) for p in prompts(2, 6)]
    [fast] = compare(tiny, [again, again], SPECULATION, kv_cache_dtype="int8")
    counters = fast.stats().counters
    assert counters.prefix_cache_hit_tokens > 0


# One sentence: the copy ends by its own EOS (about 26 tokens) inside each request's max_tokens, and
# every decode step of the default model costs a pytest process 0.1 CPU-s: the three-sentence
# paragraph this was took twice the CPU for the same properties (a copy accepted from the prompt,
# an EOS inside accepted runs).
PARAGRAPH = (
    "The river rose slowly through the night, and by morning the low fields beside the mill were "
    "under a foot of brown water."
)


@pytest.fixture(scope="module")
def default_model(default_model_dir):
    return load_model(str(default_model_dir), device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def int4_default_model(default_model_dir):
    """The default model with int4 weights, loaded once for the module's int4 checks."""
    return load_model(str(default_model_dir), device="cpu", dtype="float32", quantization="int4")


def chat(loaded, text: str) -> list[int]:
    messages = [{"role": "user", "content": text}]
    text = loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(loaded.tokenizer(text, add_special_tokens=False)["input_ids"])


def test_the_default_model_copying_a_paragraph_is_unchanged_by_lookup_and_by_its_int4_draft(
    default_model, int4_default_model
):
    """One plain run of the float default model is the reference of two speculating engines: the
    n-gram lookup (the copy's proposals come from the prompt: many are right) and the int4 copy of
    the model drafting for it (it agrees with the float model on most tokens)."""
    copy = chat(default_model, f"Repeat exactly: {PARAGRAPH}")
    batch = [
        request(copy, temperature=0.0, max_tokens=60),
        request(chat(default_model, "Name three colours."), temperature=0.0, max_tokens=24),
        request(copy, temperature=0.7, seed=3, max_tokens=12),
    ]
    drafting = Speculation(tokens=4, min_n=2, max_n=3, draft=DraftModel(int4_default_model, default_model))
    lookup, draft = (
        fast.stats().counters for fast in compare(default_model, [batch], (SPECULATION, drafting))
    )
    assert lookup.speculative_accepted_tokens > 0
    assert draft.speculative_accepted_tokens >= 0.5 * draft.speculative_proposed_tokens > 0


def test_with_batch_invariant_steps_the_int4_default_model_gives_the_same_bits(int4_default_model):
    """The int4 model's logits are coarse: exact ties between its two best tokens are common, so
    only batch-invariant steps (each token computed alike in a chunk or alone) make every greedy
    text equal; "Name three colours." ties within its first tokens. A seeded sampled row's tokens
    are equal bit for bit as well."""
    int4 = int4_default_model
    batch = [
        request(chat(int4, f"Repeat exactly: {PARAGRAPH}"), temperature=0.0, max_tokens=40),
        request(chat(int4, "Name three colours."), temperature=0.0, max_tokens=24),
        # Seeded sampled rows draw the same tokens too (each draw sees the same logits).
        request(
            chat(int4, f"Repeat exactly: {PARAGRAPH}"), temperature=0.8, top_p=0.95, seed=9, max_tokens=24
        ),
    ]
    [fast] = compare(int4, [batch], batch_invariant=True)
    counters = fast.stats().counters
    assert counters.speculative_accepted_tokens > 0


# ------------------------------------------------------------------ the draft model


def greedy_continuation(loaded, tokens: list[int], k: int) -> list[int]:
    """``k`` greedy tokens of ``loaded`` after ``tokens``, each from a full forward (no cache)."""
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(k):
            logits = loaded.model(torch.tensor([tokens + out])).logits[0, -1]
            out.append(int(logits[: len(loaded.tokenizer)].argmax()))
    return out


def test_the_draft_model_proposes_its_greedy_tokens_and_follows_the_row(tiny):
    draft = DraftModel(tiny, tiny)
    row = DraftCache()
    tokens = prompts(1, 9)[0]
    assert draft.propose(row, tokens, 4) == greedy_continuation(tiny, tokens, 4)
    assert len(row.tokens) == len(tokens) + 3  # the last proposal is not computed yet
    # The row took two of them and then its own token: the cache is cut back to what still holds.
    first = draft.propose(row, tokens, 4)
    tokens = [*tokens, *first[:2], 7]
    assert draft.propose(row, tokens, 3) == greedy_continuation(tiny, tokens, 3)
    # A row that went back (preempted and recomputed, or another row's tokens) still gets them right.
    assert draft.propose(row, tokens[:5], 2) == greedy_continuation(tiny, tokens[:5], 2)
    assert draft.propose(row, tokens, 0) == []


def test_a_draft_model_must_share_the_tokenizer():
    def model(vocab: dict[str, int]) -> SimpleNamespace:
        return SimpleNamespace(tokenizer=SimpleNamespace(get_vocab=lambda: vocab), model_id="d")

    with pytest.raises(ModelLoadError, match="tokenizer") as refused:
        DraftModel(model({"a": 0}), model({"b": 0}))  # type: ignore[arg-type]
    assert refused.value.param == "draft_model"
    config = parse_config(["--speculative", "draft", "--draft-model", "/d", "--draft-quantization", "none"])
    assert (config.speculative, config.draft_model, config.draft_quantization) == ("draft", "/d", "none")
    assert parse_config([]).draft_quantization == "auto"
    assert draft_quantization("auto", torch.device("cpu")) == "int4"
    assert draft_quantization("auto", torch.device("cuda")) == "none"
    assert draft_quantization("int8", torch.device("cuda")) == "int8"
    assert DEFAULT_MAX_ROWS == {"ngram": 4, "draft": 1}  # a draft proposes one forward per row and token


def test_greedy_and_seeded_outputs_with_a_draft_model_are_unchanged(tiny, tiny_model_dir):
    """The tiny model drafting for itself (nearly every proposal right) and its int4 copy drafting
    for it (its guesses differ: rejections)."""
    int4 = load_model(str(tiny_model_dir), device="cpu", dtype="float32", quantization="int4")
    batch = [request(p, temperature=0.0, max_tokens=24, ignore_eos=True) for p in prompts(3, 11)]
    batch.append(request(prompts(1, 12)[0], temperature=0.8, seed=4, max_tokens=16, ignore_eos=True))
    drafts = [Speculation(tokens=4, min_n=1, max_n=3, draft=DraftModel(d, tiny)) for d in (tiny, int4)]
    engines = compare(tiny, [batch], drafts)  # one plain run is the reference of both drafts
    for fast in engines:
        assert fast.stats().counters.speculative_accepted_tokens > 0
    counters = engines[-1].stats().counters  # the int4 copy's
    assert counters.speculative_accepted_tokens < counters.speculative_proposed_tokens
