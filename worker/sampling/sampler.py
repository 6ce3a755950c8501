"""Sampling for a whole batch at once, on the logits' own device.

Design notes: docs/worker.md.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from worker.sampling.grammar import TokenConstraint
from worker.types import SampledLogprobs, SamplingOptions

_MASK64 = (1 << 64) - 1


def uniform(seed: int, step: int) -> float:
    """A uniform number in [0, 1) from (seed, step): SplitMix64 of their mix, 53 bits."""
    x = (seed + (step + 1) * 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    x ^= x >> 31
    return (x >> 11) * (1.0 / (1 << 53))


@dataclass
class SequenceSampling:
    """The sampling state of one sequence (one choice): its options, its seed and what it generated.

    Owned by the engine thread. ``record`` after each drawn token.
    """

    options: SamplingOptions
    prompt_token_ids: tuple[int, ...]
    blocked_before_min: frozenset[int]  # EOS and stop token ids
    seed_offset: int = 0
    constraint: TokenConstraint | None = None
    seed: int = field(init=False)
    output_token_ids: list[int] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        base = self.options.seed
        self.seed = (base + self.seed_offset) % (2**63) if base is not None else random.getrandbits(63)

    @property
    def generated(self) -> int:
        return len(self.output_token_ids)

    def record(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        if self.constraint is not None:
            self.constraint.advance(token_id)

    @property
    def masks_stops(self) -> bool:
        return bool(self.blocked_before_min) and self.generated < self.options.min_tokens


@dataclass(frozen=True)
class Sample:
    """One row's draw: the token and, when asked, its logprob entry (ids only; texts come later)."""

    token_id: int
    logprobs: SampledLogprobs | None = None


class GrammarFailure(Exception):
    """A row's grammar could not compute its mask; ``rows`` says which rows (the others sampled fine)."""

    def __init__(self, rows: list[int], samples: list[Sample]):
        super().__init__(f"grammar failed for rows {rows}")
        self.rows = rows
        self.samples = samples


def sample_batch(logits: torch.Tensor, rows: Sequence[SequenceSampling]) -> list[Sample]:
    """Draws one token per row of ``logits`` [rows, vocab] (row ``i`` with ``rows[i]``).

    Raises :class:`GrammarFailure` when some rows' grammars fail; it carries the other rows' samples.
    """
    logits = logits.float()
    count = len(rows)
    asked = [i for i, r in enumerate(rows) if r.options.logprobs is not None]
    raw = torch.log_softmax(logits[asked], dim=-1) if asked else None
    logits, grammar_failed = _processed(logits, rows)
    chosen = torch.empty(count, dtype=torch.long, device=logits.device)
    greedy = [i for i, r in enumerate(rows) if r.options.greedy]
    sorting = [i for i, r in enumerate(rows) if not r.options.greedy and _needs_sort(r.options)]
    plain = [i for i, r in enumerate(rows) if not r.options.greedy and not _needs_sort(r.options)]
    if len(greedy) == count:
        chosen = logits.argmax(dim=-1)
    elif greedy:
        chosen[_index(greedy, logits)] = logits[_index(greedy, logits)].argmax(dim=-1)
    for group, draw in ((sorting, _draw_sorted), (plain, _draw_plain)):
        if group:
            index = _index(group, logits)
            chosen[index] = draw(logits[index], [rows[i] for i in group])
    tokens = [int(t) for t in chosen.tolist()]
    entries: list[SampledLogprobs | None] = [None] * count
    if raw is not None:
        picked = [tokens[i] for i in asked]
        for row, entry in zip(asked, _logprob_entries(raw, picked, rows, asked), strict=True):
            entries[row] = entry
    samples = [Sample(token, entry) for token, entry in zip(tokens, entries, strict=True)]
    if grammar_failed:
        raise GrammarFailure(grammar_failed, samples)
    return samples


def _index(rows: list[int], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long, device=like.device)


def _needs_sort(options: SamplingOptions) -> bool:
    return options.top_k > 0 or options.top_p < 1.0


def _processed(logits: torch.Tensor, rows: Sequence[SequenceSampling]) -> tuple[torch.Tensor, list[int]]:
    """Logit bias, penalties, the min_tokens mask and grammar masks, each batched over the rows that
    need it. Returns the new logits and the rows whose grammar failed."""
    device, vocab = logits.device, logits.shape[-1]
    bias = [(i, r.options.logit_bias) for i, r in enumerate(rows) if r.options.logit_bias]
    repetition = [i for i, r in enumerate(rows) if r.options.repetition_penalty != 1.0]
    counted = [
        i
        for i, r in enumerate(rows)
        if r.output_token_ids and (r.options.presence_penalty or r.options.frequency_penalty)
    ]
    masked = [i for i, r in enumerate(rows) if r.masks_stops]
    grammar = [i for i, r in enumerate(rows) if r.constraint is not None]
    if not (bias or repetition or counted or masked or grammar):
        return logits, []
    logits = logits.clone()
    if bias:
        row_ids = [i for i, pairs in bias for _ in pairs]
        token_ids = [t for _, pairs in bias for t, _ in pairs]
        values = [v for _, pairs in bias for _, v in pairs]
        logits.index_put_(
            (_tensor(row_ids, device), _tensor(token_ids, device)),
            torch.tensor(values, dtype=logits.dtype, device=device),
            accumulate=True,
        )
    if repetition:
        index = _padded(
            [list(rows[i].prompt_token_ids) + rows[i].output_token_ids for i in repetition], device
        )
        sub = logits[_tensor(repetition, device)]
        penalty = torch.tensor(
            [rows[i].options.repetition_penalty for i in repetition], dtype=logits.dtype, device=device
        )[:, None]
        seen = sub.gather(1, index)
        sub.scatter_(1, index, torch.where(seen > 0, seen / penalty, seen * penalty))
        logits[_tensor(repetition, device)] = sub
    if counted:
        index = _padded([rows[i].output_token_ids for i in counted], device, pad=vocab)
        counts = torch.zeros((len(counted), vocab + 1), dtype=logits.dtype, device=device)
        counts.scatter_add_(1, index, torch.ones_like(index, dtype=logits.dtype))
        counts = counts[:, :vocab]
        frequency = torch.tensor([rows[i].options.frequency_penalty for i in counted], device=device)
        presence = torch.tensor([rows[i].options.presence_penalty for i in counted], device=device)
        logits[_tensor(counted, device)] -= frequency[:, None] * counts + presence[:, None] * (counts > 0)
    if masked:
        row_ids = [i for i in masked for _ in rows[i].blocked_before_min]
        token_ids = [t for i in masked for t in sorted(rows[i].blocked_before_min)]
        logits[_tensor(row_ids, device), _tensor(token_ids, device)] = float("-inf")
    failed: list[int] = []
    if grammar:
        allowed, failed = _grammar_masks([rows[i] for i in grammar], vocab)
        failed = [grammar[j] for j in failed]
        sub = logits[_tensor(grammar, device)]
        logits[_tensor(grammar, device)] = sub.masked_fill(~allowed.to(device), float("-inf"))
    return logits, failed


def _tensor(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


def _padded(lists: list[list[int]], device: torch.device, pad: int | None = None) -> torch.Tensor:
    """Token-id lists as one [rows, longest] tensor; short rows are padded with ``pad`` (default: the
    row's own first id, a harmless repeat for gather/scatter of the same value)."""
    width = max(len(ids) for ids in lists)
    padded = [ids + [ids[0] if pad is None else pad] * (width - len(ids)) for ids in lists]
    return torch.tensor(padded, dtype=torch.long, device=device)


def _grammar_masks(rows: list[SequenceSampling], vocab: int) -> tuple[torch.Tensor, list[int]]:
    """Allowed-token masks [rows, vocab] from the rows' grammars (one packed bitmask, unpacked in one
    operation); a row whose grammar raises allows everything and is listed as failed. Logit columns
    past the grammar's vocabulary (embedding padding) are never allowed."""
    constraints = [row.constraint for row in rows if row.constraint is not None]
    words = constraints[0].mask_words
    bitmask = torch.full((len(rows), words), -1, dtype=torch.int32)
    failed = []
    for index, constraint in enumerate(constraints):
        try:
            constraint.fill_mask(bitmask[index])
        except Exception:
            failed.append(index)
            bitmask[index] = -1
    bits = (bitmask[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
    allowed = bits.reshape(len(rows), words * 32).bool()
    if allowed.shape[1] >= vocab:
        return allowed[:, :vocab], failed
    return torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False), failed


def _draw_plain(logits: torch.Tensor, rows: list[SequenceSampling]) -> torch.Tensor:
    """Rows with neither top_k nor top_p: temperature, min_p, inverse CDF over the vocabulary."""
    probs = torch.softmax(logits / _temperatures(rows, logits), dim=-1)
    probs = _min_p(probs, probs.max(dim=-1, keepdim=True).values, rows)
    return _inverse_cdf(probs, rows)


def _draw_sorted(logits: torch.Tensor, rows: list[SequenceSampling]) -> torch.Tensor:
    """Rows with top_k or top_p: one descending sort, the filters on sorted positions, the draw in
    sorted order, mapped back to token ids."""
    ordered, order = torch.sort(logits / _temperatures(rows, logits), dim=-1, descending=True)
    vocab = ordered.shape[-1]
    top_k = torch.tensor(
        [r.options.top_k if 0 < r.options.top_k < vocab else vocab for r in rows], device=logits.device
    )
    positions = torch.arange(vocab, device=logits.device)[None, :]
    ordered = ordered.masked_fill(positions >= top_k[:, None], float("-inf"))
    probs = torch.softmax(ordered, dim=-1)
    top_p = torch.tensor([r.options.top_p for r in rows], dtype=probs.dtype, device=logits.device)
    # Keep the smallest prefix whose mass reaches top_p (always at least the first token).
    probs = probs.masked_fill(torch.cumsum(probs, dim=-1) - probs >= top_p[:, None], 0.0)
    probs = _min_p(probs, probs[:, :1], rows)
    return order.gather(1, _inverse_cdf(probs, rows)[:, None])[:, 0]


def _temperatures(rows: list[SequenceSampling], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor([r.options.temperature for r in rows], dtype=like.dtype, device=like.device)[:, None]


def _min_p(probs: torch.Tensor, best: torch.Tensor, rows: list[SequenceSampling]) -> torch.Tensor:
    if not any(r.options.min_p > 0 for r in rows):
        return probs
    min_p = torch.tensor([r.options.min_p for r in rows], dtype=probs.dtype, device=probs.device)
    return probs.masked_fill(probs < min_p[:, None] * best, 0.0)


def _inverse_cdf(probs: torch.Tensor, rows: list[SequenceSampling]) -> torch.Tensor:
    """One draw per row from its (unnormalised) probabilities with the row's own uniform number."""
    u = torch.tensor([uniform(r.seed, r.generated) for r in rows], dtype=torch.float64, device=probs.device)
    cdf = probs.double().cumsum(dim=-1)
    picks = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)
    return picks[:, 0].clamp_(max=probs.shape[-1] - 1)


def _logprob_entries(
    raw: torch.Tensor, chosen: list[int], rows: Sequence[SequenceSampling], asked: list[int]
) -> list[SampledLogprobs]:
    """The chosen tokens' raw logprobs and each row's top alternatives, moved to the host at once."""
    picked = raw.gather(1, _index(chosen, raw)[:, None])[:, 0].tolist()
    widest = max(rows[i].options.logprobs or 0 for i in asked)
    top_values: list[list[float]] = [[] for _ in asked]
    top_ids: list[list[int]] = [[] for _ in asked]
    if widest:
        values, ids = torch.topk(raw, widest, dim=-1)
        top_values, top_ids = values.tolist(), ids.tolist()
    entries = []
    for n, i in enumerate(asked):
        width = rows[i].options.logprobs or 0
        entries.append(
            SampledLogprobs(
                chosen[n], float(picked[n]), tuple(top_ids[n][:width]), tuple(top_values[n][:width])
            )
        )
    return entries


def blocked_ids(eos_ids: Iterable[int], options: SamplingOptions) -> frozenset[int]:
    """Token ids that may not be drawn before ``min_tokens`` (EOS unless ignored, and stop ids)."""
    ids = set(options.stop_token_ids)
    if not options.ignore_eos:
        ids.update(eos_ids)
    return frozenset(ids)
