"""Speculative decoding's engine side: which rows may speculate, their n-gram proposals, and how
many proposed tokens a verifying forward accepted (greedy rows only, so exactly lossless)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from worker.sampling.ngram import propose
from worker.sampling.sampler import SequenceSampling


@dataclass(frozen=True)
class Speculation:
    """``--speculative ngram`` with its sizes: ``tokens`` proposals a step, suffixes of
    ``min_n``..``max_n`` tokens, only in steps where at most ``max_rows`` sequences decode (None:
    any number)."""

    tokens: int
    min_n: int
    max_n: int
    max_rows: int | None = None

    def proposals(self, sampling: SequenceSampling, tokens: Sequence[int], room: int) -> list[int]:
        """What the row may verify this step: at most ``room`` tokens, none unless it is eligible."""
        limit = min(self.tokens, room)
        if limit <= 0 or not eligible(sampling):
            return []
        return propose(tokens, min_n=self.min_n, max_n=self.max_n, k=limit)


def eligible(sampling: SequenceSampling) -> bool:
    """A row may speculate when its next tokens are each the argmax of the raw logits: greedy
    (temperature 0) with nothing that changes or reports the logits (grammar, logprobs, penalties,
    logit_bias, bad_words, allowed_token_ids, a pending min_tokens)."""
    options = sampling.options
    return (
        options.greedy
        and sampling.constraint is None
        and options.logprobs is None
        and not options.logit_bias
        and options.repetition_penalty == 1.0
        and not options.presence_penalty
        and not options.frequency_penalty
        and not options.bad_words
        and not options.allowed_token_ids
        and not sampling.masks_stops
    )


def accepted(proposals: Sequence[int], argmax: Sequence[int]) -> list[int]:
    """The tokens a verified row gains: ``argmax[i]`` is the greedy token after proposal ``i - 1``
    (``argmax[0]`` after the row's last known token); the proposals that match, then one more."""
    gained: list[int] = []
    for proposal, best in zip(proposals, argmax, strict=False):
        gained.append(best)
        if best != proposal:
            return gained
    gained.append(argmax[len(proposals)])
    return gained
