"""Per-sequence sampling: logits processors, the draw, and logprobs.

Order of operations for one sequence and one step (the same as OpenAI's and
vLLM's documented behaviour):

1. logprobs, when asked, are the model's log-softmax of the raw logits, before
   any sampling transform (so they do not depend on temperature or top_p);
2. logit_bias is added; repetition, presence and frequency penalties apply;
   stop tokens are masked while fewer than ``min_tokens`` were generated;
   a grammar constraint, if any, masks every token it does not allow;
3. temperature 0 takes the argmax; otherwise temperature, top_k, top_p and
   min_p filter, and one token is drawn with the sequence's own generator, so
   a seeded request gives the same tokens whatever else runs in the batch.

The engine calls :func:`choose_batch` once per step for all rows.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from worker.grammar import TokenConstraint
from worker.types import SamplingOptions, TokenLogprob, TopLogprob

TokenInfo = Callable[[int], tuple[str, bytes]]


@dataclass
class SequenceSampler:
    """Sampling state of one sequence (its generator and token counts)."""

    options: SamplingOptions
    prompt_token_ids: tuple[int, ...]
    blocked_before_min: frozenset[int]  # EOS and stop token ids
    seed_offset: int = 0
    constraint: TokenConstraint | None = None  # grammar-constrained decoding
    generator: torch.Generator = field(init=False)
    _counts: dict[int, int] = field(default_factory=dict, init=False)
    _generated: int = field(default=0, init=False)
    _bias_ids: torch.Tensor | None = field(default=None, init=False)
    _bias_values: torch.Tensor | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.generator = torch.Generator()
        seed = self.options.seed
        self.generator.manual_seed(
            (seed + self.seed_offset) % (2**63) if seed is not None else random.getrandbits(63)
        )
        if self.options.logit_bias:
            ids, values = zip(*self.options.logit_bias, strict=True)
            self._bias_ids = torch.tensor(ids, dtype=torch.long)
            self._bias_values = torch.tensor(values, dtype=torch.float32)

    def record(self, token_id: int) -> None:
        self._counts[token_id] = self._counts.get(token_id, 0) + 1
        self._generated += 1
        if self.constraint is not None:
            self.constraint.advance(token_id)

    @property
    def generated(self) -> int:
        return self._generated

    def choose(self, logits: torch.Tensor, token_info: TokenInfo) -> tuple[int, TokenLogprob | None]:
        """Picks the next token from one row of logits (shape [vocab]); returns it and its logprob."""
        return choose_batch(logits[None], [self], token_info)[0]

    @property
    def needs_processing(self) -> bool:
        opts = self.options
        return bool(
            self._bias_ids is not None
            or self.constraint is not None
            or opts.repetition_penalty != 1.0
            or (self._counts and (opts.presence_penalty or opts.frequency_penalty))
            or (self.blocked_before_min and self.generated < opts.min_tokens)
        )

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """Applies logit_bias, penalties and the min_tokens mask to one row (a new tensor)."""
        opts = self.options
        logits = logits.clone()
        if self._bias_ids is not None and self._bias_values is not None:
            logits.index_add_(0, self._bias_ids, self._bias_values)
        if opts.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(self.prompt_token_ids) | set(self._counts)), dtype=torch.long)
            if seen.numel():
                values = logits[seen]
                logits[seen] = torch.where(
                    values > 0, values / opts.repetition_penalty, values * opts.repetition_penalty
                )
        if self._counts and (opts.presence_penalty or opts.frequency_penalty):
            ids = torch.tensor(list(self._counts), dtype=torch.long)
            counts = torch.tensor(list(self._counts.values()), dtype=torch.float32)
            logits[ids] -= opts.frequency_penalty * counts + opts.presence_penalty
        if self.blocked_before_min and self.generated < opts.min_tokens:
            logits[torch.tensor(sorted(self.blocked_before_min), dtype=torch.long)] = float("-inf")
        if self.constraint is not None:
            # Last, so the grammar wins over bias and min_tokens: only allowed tokens can be drawn.
            logits.masked_fill_(~self.constraint.allowed(logits.shape[-1]), float("-inf"))
        return logits


def choose_batch(
    logits: torch.Tensor, samplers: list[SequenceSampler], token_info: TokenInfo
) -> list[tuple[int, TokenLogprob | None]]:
    """Picks one token per row of ``logits`` [rows, vocab], row ``i`` with ``samplers[i]``.

    Work is batched across rows where the rows allow it: one argmax for all
    greedy rows; one softmax and one inverse-CDF draw for all sampled rows.
    Each row's uniform number comes from the row's own generator, so a seeded
    row draws the same tokens whatever shares its batch.
    """
    logits = logits.float()
    rows = len(samplers)
    with_logprobs = [i for i, s in enumerate(samplers) if s.options.logprobs is not None]
    raw_logprobs = torch.log_softmax(logits[with_logprobs], dim=-1) if with_logprobs else None
    processed = [i for i, s in enumerate(samplers) if s.needs_processing]
    if processed:
        logits = logits.clone()
        for i in processed:
            logits[i] = samplers[i].process(logits[i])
    tokens = [0] * rows
    greedy = [i for i, s in enumerate(samplers) if s.options.greedy]
    if greedy:
        for i, token in zip(greedy, _rows(logits, greedy).argmax(dim=-1).tolist(), strict=True):
            tokens[i] = int(token)
    sampled = [i for i, s in enumerate(samplers) if not s.options.greedy]
    if sampled:
        for i, token in zip(
            sampled, _draw([samplers[i] for i in sampled], _rows(logits, sampled)), strict=True
        ):
            tokens[i] = token
    results: list[tuple[int, TokenLogprob | None]] = [(token, None) for token in tokens]
    if raw_logprobs is not None:
        for row, i in enumerate(with_logprobs):
            top_n = samplers[i].options.logprobs or 0
            results[i] = (tokens[i], _logprob_entry(raw_logprobs[row], tokens[i], top_n, token_info))
    return results


def _rows(logits: torch.Tensor, indices: list[int]) -> torch.Tensor:
    """``logits[indices]``, without the copy a gather makes when ``indices`` is every row (the usual
    decode step, where all rows sample the same way). Readers only: ``_draw`` divides first."""
    return logits if len(indices) == logits.shape[0] else logits[indices]


def _draw(samplers: list[SequenceSampler], logits: torch.Tensor) -> list[int]:
    temperatures = torch.tensor([s.options.temperature for s in samplers], dtype=torch.float32)
    logits = logits / temperatures[:, None]
    for row, sampler in enumerate(samplers):
        top_k = sampler.options.top_k
        if 0 < top_k < logits.shape[-1]:
            kth = torch.topk(logits[row], top_k).values[-1]
            logits[row] = logits[row].masked_fill(logits[row] < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    for row, sampler in enumerate(samplers):
        top_p = sampler.options.top_p
        if top_p < 1.0:
            sorted_probs, order = torch.sort(probs[row], descending=True)
            # Keep the smallest set whose mass reaches top_p (always at least one token).
            drop = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= top_p
            probs[row] = torch.zeros_like(probs[row]).scatter_(0, order, sorted_probs.masked_fill(drop, 0.0))
    min_p = torch.tensor([s.options.min_p for s in samplers], dtype=torch.float32)
    if bool((min_p > 0).any()):
        probs = probs.masked_fill(probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values, 0.0)
    # Inverse-CDF draw: one uniform number per row from the row's own generator.
    uniform = torch.cat([torch.rand(1, generator=s.generator) for s in samplers])
    cdf = probs.cumsum(dim=-1)
    picks = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None]).clamp_(max=probs.shape[-1] - 1)
    return [int(t) for t in picks[:, 0].tolist()]


def _logprob_entry(logprobs: torch.Tensor, token_id: int, top_n: int, token_info: TokenInfo) -> TokenLogprob:
    text, raw = token_info(token_id)
    top: list[TopLogprob] = []
    if top_n > 0:
        values, ids = torch.topk(logprobs, top_n)
        for value, alt in zip(values.tolist(), ids.tolist(), strict=True):
            alt_text, alt_bytes = token_info(alt)
            top.append(TopLogprob(alt, alt_text, float(value), alt_bytes))
    return TokenLogprob(token_id, text, float(logprobs[token_id]), raw, tuple(top))


def blocked_ids(eos_ids: Iterable[int], options: SamplingOptions) -> frozenset[int]:
    """Token ids that may not be drawn before ``min_tokens`` (EOS unless ignored, and stop ids)."""
    ids = set(options.stop_token_ids)
    if not options.ignore_eos:
        ids.update(eos_ids)
    return frozenset(ids)
