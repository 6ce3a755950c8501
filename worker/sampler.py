"""Per-sequence sampling: logits processors, the draw, and logprobs.

Order of operations for one sequence and one step (the same as OpenAI's and
vLLM's documented behaviour):

1. logprobs, when asked, are the model's log-softmax of the raw logits, before
   any sampling transform (so they do not depend on temperature or top_p);
2. logit_bias is added; repetition, presence and frequency penalties apply;
   stop tokens are masked while fewer than ``min_tokens`` were generated;
3. temperature 0 takes the argmax; otherwise temperature, top_k, top_p and
   min_p filter, and one token is drawn with the sequence's own generator, so
   a seeded request gives the same tokens whatever else runs in the batch.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from worker.types import SamplingOptions, TokenLogprob, TopLogprob

TokenInfo = Callable[[int], tuple[str, bytes]]


@dataclass
class SequenceSampler:
    """Sampling state of one sequence (its generator and token counts)."""

    options: SamplingOptions
    prompt_token_ids: tuple[int, ...]
    blocked_before_min: frozenset[int]  # EOS and stop token ids
    seed_offset: int = 0
    generator: torch.Generator = field(init=False)
    _counts: dict[int, int] = field(default_factory=dict, init=False)
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

    @property
    def generated(self) -> int:
        return sum(self._counts.values())

    def choose(self, logits: torch.Tensor, token_info: TokenInfo) -> tuple[int, TokenLogprob | None]:
        """Picks the next token from one row of logits (shape [vocab]); returns it and its logprob."""
        logits = logits.float()
        logprob_entry = None
        raw_logprobs = torch.log_softmax(logits, dim=-1) if self.options.logprobs is not None else None
        logits = self._process(logits)
        token_id = self._draw(logits)
        if raw_logprobs is not None:
            logprob_entry = _logprob_entry(raw_logprobs, token_id, self.options.logprobs or 0, token_info)
        return token_id, logprob_entry

    def _process(self, logits: torch.Tensor) -> torch.Tensor:
        opts = self.options
        needs_copy = (
            self._bias_ids is not None
            or opts.repetition_penalty != 1.0
            or (self._counts and (opts.presence_penalty or opts.frequency_penalty))
            or (self.blocked_before_min and self.generated < opts.min_tokens)
        )
        if not needs_copy:
            return logits
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
        return logits

    def _draw(self, logits: torch.Tensor) -> int:
        opts = self.options
        if opts.greedy:
            return int(torch.argmax(logits))
        logits = logits / opts.temperature
        if 0 < opts.top_k < logits.numel():
            kth = torch.topk(logits, opts.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if opts.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            # Keep the smallest set whose mass reaches top_p (always at least one token).
            drop = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= opts.top_p
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        if opts.min_p > 0.0:
            probs = probs.masked_fill(probs < opts.min_p * probs.max(), 0.0)
        return int(torch.multinomial(probs, 1, generator=self.generator))


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
