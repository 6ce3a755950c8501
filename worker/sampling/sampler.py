"""Sampling for a whole batch at once, on the logits' own device.

Design notes: docs/worker.md.
"""

from __future__ import annotations

import operator
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from worker.device.staging import fence, staged, to_host
from worker.sampling.grammar import TokenConstraint
from worker.sampling.thinking_budget import BudgetedThinking
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
    thinking: BudgetedThinking | None = None  # a thinking budget's state (thinking_budget.py)
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
        if self.thinking is not None:
            self.thinking.record(token_id)

    def forced(self) -> int | None:
        """The token this draw must be (a spent thinking budget's end of the block), or None."""
        return self.thinking.forced() if self.thinking is not None else None

    def banned_now(self) -> list[int]:
        """The ``bad_words`` tokens this draw may not pick: each one-token word, and the last token of
        each longer word whose other tokens end the output."""
        out = self.output_token_ids
        return [
            word[-1]
            for word in self.options.bad_words
            if len(word) == 1
            or (len(word) - 1 <= len(out) and tuple(out[len(out) - len(word) + 1 :]) == word[:-1])
        ]

    @property
    def masks_stops(self) -> bool:
        return bool(self.blocked_before_min) and self.generated < self.options.min_tokens


@dataclass(slots=True)  # not frozen: one per row and step (see worker.types.ContentDelta)
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


@dataclass
class _Batch:
    """One batch composition's per-row parameters as device tensors (built once, reused while the
    same rows sample again) and its penalty state, advanced on the device by each step's draw."""

    rows: tuple[SequenceSampling, ...]
    device: torch.device
    vocab: int
    seeds: np.ndarray
    params: dict[str, torch.Tensor | None] = field(default_factory=dict)
    indexes: dict[tuple[int, ...], torch.Tensor] = field(default_factory=dict)
    seen: torch.Tensor | None = None  # [repetition rows, vocab] bool: prompt or output ids
    counts: torch.Tensor | None = None  # [penalised rows, vocab] float: output id counts
    # The last draw: each row's output length once it recorded that draw, and the draw.
    drawn: tuple[list[int], Draw] | None = None

    def index(self, rows: list[int]) -> torch.Tensor:
        key = tuple(rows)
        if key not in self.indexes:
            self.indexes[key] = staged(rows, torch.long, self.device)
        return self.indexes[key]

    def same(self, rows: Sequence[SequenceSampling], device: torch.device, vocab: int) -> bool:
        return (
            device == self.device
            and vocab == self.vocab
            and len(rows) == len(self.rows)
            and all(map(operator.is_, rows, self.rows))
        )


_last: _Batch | None = None  # the engine thread's previous batch


def _batch(rows: Sequence[SequenceSampling], device: torch.device, vocab: int) -> _Batch:
    global _last
    if _last is None or not _last.same(rows, device, vocab):
        seeds = np.array([r.seed for r in rows], dtype=np.uint64)
        _last = _Batch(tuple(rows), device, vocab, seeds)
    return _last


def _uniforms(seeds: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """:func:`uniform` of each (seed, step) pair at once, in wrapping uint64 arithmetic."""
    x = seeds + (steps + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return (x >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def sample_batch(logits: torch.Tensor, rows: Sequence[SequenceSampling]) -> list[Sample]:
    """Draws one token per row of ``logits`` [rows, vocab] (row ``i`` with ``rows[i]``) and waits
    for them: :func:`draw_batch`, then :meth:`Draw.samples` once the device is done.

    Raises :class:`GrammarFailure` when some rows' grammars fail; it carries the other rows' samples.
    """
    draw = draw_batch(logits, rows)
    fence(logits.device)()
    return draw.samples()


@dataclass
class Draw:
    """A batch's draw as the device made it: ``chosen`` [rows] (the token ids, on the device, which
    the next step's inputs may read there), and the host copies under way (pinned, not blocking);
    :meth:`samples` reads them once the device work queued before them is done (a fence)."""

    chosen: torch.Tensor
    _tokens: torch.Tensor  # the host copy of ``chosen``
    _logprobs: tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor] | None  # rows, picked, top
    _widths: list[int]  # each asking row's number of alternatives
    _grammar_failed: list[int]
    _read: list[Sample] | None = None

    def samples(self) -> list[Sample]:
        """Each row's token and logprob entry (read once, then kept); raises :class:`GrammarFailure`
        for rows whose grammar failed (it carries every row's sample)."""
        if self._read is None:
            tokens = [int(t) for t in self._tokens.tolist()]
            entries: list[SampledLogprobs | None] = [None] * len(tokens)
            if self._logprobs is not None:
                asked, picked, values, ids = self._logprobs
                chosen_values = picked.tolist()
                top_values, top_ids = values.tolist(), ids.tolist()
                for n, (row, width) in enumerate(zip(asked, self._widths, strict=True)):
                    entries[row] = SampledLogprobs(
                        tokens[row],
                        float(chosen_values[n]),
                        tuple(top_ids[n][:width]),
                        tuple(top_values[n][:width]),
                    )
            self._read = [Sample(token, entry) for token, entry in zip(tokens, entries, strict=True)]
        if self._grammar_failed:
            raise GrammarFailure(self._grammar_failed, self._read)
        return self._read

    def recorded_by(self, rows: Sequence[SequenceSampling], lengths: list[int]) -> bool:
        """Whether each row recorded exactly this draw's token since it was made (its output is
        ``lengths`` long and ends with it); False for a draw the host never read."""
        if self._read is None:
            return False
        return all(
            len(row.output_token_ids) == n and row.output_token_ids[-1:] == [sample.token_id]
            for row, n, sample in zip(rows, lengths, self._read, strict=True)
        )


def draw_batch(logits: torch.Tensor, rows: Sequence[SequenceSampling]) -> Draw:
    """Draws one token per row of ``logits`` [rows, vocab] on their device without waiting for it:
    the host reads the result later (:meth:`Draw.samples`, after a :func:`fence`)."""
    logits = logits.float()
    count = len(rows)
    batch = _batch(rows, logits.device, logits.shape[-1])
    asked = [i for i, r in enumerate(rows) if r.options.logprobs is not None]
    raw = torch.log_softmax(logits[batch.index(asked)], dim=-1) if asked else None
    logits, grammar_failed = _processed(logits, rows, batch)
    greedy = [i for i, r in enumerate(rows) if r.options.greedy]
    if len(greedy) == count:
        chosen = logits.argmax(dim=-1)
    else:
        chosen = torch.empty(count, dtype=torch.long, device=logits.device)
        if greedy:
            chosen[batch.index(greedy)] = logits[batch.index(greedy)].argmax(dim=-1)
        steps = np.array([len(r.output_token_ids) for r in rows], dtype=np.uint64)
        u = _uniforms(batch.seeds, steps)
        sorting = [i for i, r in enumerate(rows) if not r.options.greedy and _needs_sort(r.options)]
        plain = [i for i, r in enumerate(rows) if not r.options.greedy and not _needs_sort(r.options)]
        for name, group, draw in (("sorted", sorting, _draw_sorted), ("plain", plain, _draw_plain)):
            if group:
                index = batch.index(group)
                params = _group_params(batch, name, [rows[i] for i in group], logits.shape[-1])
                uniforms = staged(u[group].tolist(), torch.float64, logits.device)
                chosen[index] = draw(logits[index], params, uniforms)
    logprobs = None
    widths: list[int] = []
    if raw is not None:
        picked_ids = chosen[batch.index(asked)]
        picked = raw.gather(1, picked_ids[:, None])[:, 0]
        widths = [rows[i].options.logprobs or 0 for i in asked]
        values, ids = torch.topk(raw, max(widths), dim=-1)  # width 0: empty [rows, 0] tensors
        logprobs = (asked, to_host(picked), to_host(values), to_host(ids))
    drawn = Draw(chosen, to_host(chosen), logprobs, widths, grammar_failed)
    batch.drawn = ([len(r.output_token_ids) + 1 for r in rows], drawn)
    return drawn


def _group_params(
    batch: _Batch, name: str, rows: list[SequenceSampling], vocab: int
) -> dict[str, torch.Tensor | None]:
    """A draw group's temperatures, top_k, top_p and min_p tensors (cached with the batch)."""
    key = f"{name}:temperature"
    if key not in batch.params:
        device = batch.device
        batch.params[key] = staged([r.options.temperature for r in rows], torch.float32, device)[:, None]
        top_k = [r.options.top_k if 0 < r.options.top_k < vocab else vocab for r in rows]
        batch.params[f"{name}:top_k"] = staged(top_k, torch.long, device)
        batch.params[f"{name}:top_p"] = staged([r.options.top_p for r in rows], torch.float32, device)
        min_p = [r.options.min_p for r in rows]
        batch.params[f"{name}:min_p"] = (
            staged(min_p, torch.float32, device) if any(m > 0 for m in min_p) else None
        )
    keys = ("temperature", "top_k", "top_p", "min_p")
    return {k: batch.params[f"{name}:{k}"] for k in keys}


def _needs_sort(options: SamplingOptions) -> bool:
    return options.top_k > 0 or options.top_p < 1.0


def _penalty_state(
    batch: _Batch, rows: Sequence[SequenceSampling], repetition: list[int], counted: list[int]
) -> None:
    """Brings the batch's seen-token masks and output counts up to date: by the last draw, on the
    device, when every row recorded exactly that token since; otherwise rebuilt from the rows."""
    device, vocab = batch.device, batch.vocab
    drawn, batch.drawn = batch.drawn, None
    if drawn is not None and (batch.seen is not None or batch.counts is not None):
        lengths, last = drawn
        chosen = last.chosen
        if last.recorded_by(rows, lengths):
            if repetition and batch.seen is not None:
                batch.seen.scatter_(1, chosen[batch.index(repetition)][:, None], True)
            if counted and batch.counts is not None:
                picked = chosen[batch.index(counted)][:, None]
                batch.counts.scatter_add_(1, picked, torch.ones_like(picked, dtype=batch.counts.dtype))
            return
    if repetition:
        index = _padded(
            [list(rows[i].prompt_token_ids) + rows[i].output_token_ids for i in repetition], device
        )
        batch.seen = torch.zeros((len(repetition), vocab), dtype=torch.bool, device=device)
        batch.seen.scatter_(1, index, True)
    if counted:
        index = _padded([rows[i].output_token_ids or [vocab] for i in counted], device, pad=vocab)
        counts = torch.zeros((len(counted), vocab + 1), dtype=torch.float32, device=device)
        counts.scatter_add_(1, index, torch.ones_like(index, dtype=torch.float32))
        batch.counts = counts[:, :vocab].contiguous()


def _processed(
    logits: torch.Tensor, rows: Sequence[SequenceSampling], batch: _Batch
) -> tuple[torch.Tensor, list[int]]:
    """Logit bias, penalties, the min_tokens mask, allowed_token_ids, bad_words and grammar masks, each
    batched over the rows that need it. Returns the new logits and the rows whose grammar failed."""
    device = logits.device
    bias = [(i, r.options.logit_bias) for i, r in enumerate(rows) if r.options.logit_bias]
    repetition = [i for i, r in enumerate(rows) if r.options.repetition_penalty != 1.0]
    counted = [i for i, r in enumerate(rows) if r.options.presence_penalty or r.options.frequency_penalty]
    masked = [i for i, r in enumerate(rows) if r.masks_stops]
    grammar = [i for i, r in enumerate(rows) if r.constraint is not None]
    allowed = [i for i, r in enumerate(rows) if r.options.allowed_token_ids]
    width = logits.shape[-1]
    banned = [(i, t) for i, r in enumerate(rows) for t in r.banned_now() if t < width]
    forced = [(i, t) for i, r in enumerate(rows) if (t := r.forced()) is not None]
    if repetition or counted:
        _penalty_state(batch, rows, repetition, counted)
    if not (bias or repetition or counted or masked or grammar or allowed or banned or forced):
        return logits, []
    logits = logits.clone()
    params = batch.params
    if bias:
        if "bias:values" not in params:
            params["bias:rows"] = staged([i for i, pairs in bias for _ in pairs], torch.long, device)
            params["bias:tokens"] = staged([t for _, pairs in bias for t, _ in pairs], torch.long, device)
            params["bias:values"] = staged([v for _, pairs in bias for _, v in pairs], logits.dtype, device)
        logits.index_put_(
            (_cached(params, "bias:rows"), _cached(params, "bias:tokens")),
            _cached(params, "bias:values"),
            accumulate=True,
        )
    if repetition and batch.seen is not None:
        if "repetition" not in params:
            penalties = [rows[i].options.repetition_penalty for i in repetition]
            params["repetition"] = staged(penalties, logits.dtype, device)[:, None]
        penalty = _cached(params, "repetition")
        index = batch.index(repetition)
        sub = logits[index]
        penalised = torch.where(sub > 0, sub / penalty, sub * penalty)
        logits[index] = torch.where(batch.seen, penalised, sub)
    if counted and batch.counts is not None:
        if "frequency" not in params:
            params["frequency"] = staged(
                [rows[i].options.frequency_penalty for i in counted], torch.float32, device
            )
            params["presence"] = staged(
                [rows[i].options.presence_penalty for i in counted], torch.float32, device
            )
        counts = batch.counts
        frequency, presence = _cached(params, "frequency"), _cached(params, "presence")
        logits[batch.index(counted)] -= frequency[:, None] * counts + presence[:, None] * (counts > 0)
    if masked:
        row_ids = [i for i in masked for _ in rows[i].blocked_before_min]
        token_ids = [t for i in masked for t in sorted(rows[i].blocked_before_min)]
        logits[staged(row_ids, torch.long, device), staged(token_ids, torch.long, device)] = float("-inf")
    if allowed:
        if "allowed" not in params:
            mask = torch.zeros((len(allowed), width), dtype=torch.bool)
            for n, i in enumerate(allowed):
                mask[n, [t for t in rows[i].options.allowed_token_ids if t < width]] = True
            params["allowed"] = mask.to(device, non_blocking=True)
        index = batch.index(allowed)
        logits[index] = logits[index].masked_fill(~_cached(params, "allowed"), float("-inf"))
    if banned:
        row_ids, token_ids = [i for i, _ in banned], [t for _, t in banned]
        logits[staged(row_ids, torch.long, device), staged(token_ids, torch.long, device)] = float("-inf")
    failed: list[int] = []
    if grammar:
        bitmask, failed = _grammar_bitmask([rows[i] for i in grammar], device)
        failed = [grammar[j] for j in failed]
        index = batch.index(grammar)
        logits[index] = _apply_bitmask(logits[index], bitmask)
    if forced:  # last: a forced token is the draw whatever else masked it
        forced_rows = staged([i for i, _ in forced], torch.long, device)
        logits[forced_rows] = float("-inf")
        logits[forced_rows, staged([t for _, t in forced], torch.long, device)] = 0.0
    return logits, failed


def _cached(params: dict[str, torch.Tensor | None], key: str) -> torch.Tensor:
    value = params[key]
    assert value is not None
    return value


def _padded(lists: list[list[int]], device: torch.device, pad: int | None = None) -> torch.Tensor:
    """Token-id lists as one [rows, longest] tensor; short rows are padded with ``pad`` (default: the
    row's own first id, a harmless repeat for gather/scatter of the same value)."""
    width = max(len(ids) for ids in lists)
    padded = [ids + [ids[0] if pad is None else pad] * (width - len(ids)) for ids in lists]
    return staged(padded, torch.long, device)


def _grammar_bitmask(rows: list[SequenceSampling], device: torch.device) -> tuple[torch.Tensor, list[int]]:
    """The rows' packed allowed-token bitmasks [rows, words] (int32), filled on the host and copied
    to ``device`` without blocking; a row whose grammar raises allows everything and is listed."""
    constraints = [row.constraint for row in rows if row.constraint is not None]
    words = constraints[0].mask_words
    bitmask = torch.full((len(rows), words), -1, dtype=torch.int32, pin_memory=device.type == "cuda")
    failed = []
    for index, constraint in enumerate(constraints):
        try:
            constraint.fill_mask(bitmask[index])
        except Exception:
            failed.append(index)
            bitmask[index] = -1
    return bitmask.to(device, non_blocking=True), failed


def _apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """``logits`` with every token the packed ``bitmask`` does not allow set to -inf, unpacked on the
    logits' device (as llguidance's ``apply_token_bitmask_inplace``); columns past the mask's
    vocabulary (embedding padding) are never allowed."""
    rows, words = bitmask.shape
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).reshape(rows, words * 32).bool()
    vocab = logits.shape[-1]
    if allowed.shape[1] >= vocab:
        allowed = allowed[:, :vocab]
    else:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    return logits.masked_fill(~allowed, float("-inf"))


def _draw_plain(
    logits: torch.Tensor, params: dict[str, torch.Tensor | None], u: torch.Tensor
) -> torch.Tensor:
    """Rows with neither top_k nor top_p: temperature, min_p, inverse CDF over the vocabulary."""
    probs = torch.softmax(logits / _cached(params, "temperature"), dim=-1)
    probs = _min_p(probs, probs.max(dim=-1, keepdim=True).values, params["min_p"])
    return _inverse_cdf(probs, u)


def _draw_sorted(
    logits: torch.Tensor, params: dict[str, torch.Tensor | None], u: torch.Tensor
) -> torch.Tensor:
    """Rows with top_k or top_p: one descending sort, the filters on sorted positions, the draw in
    sorted order, mapped back to token ids."""
    # Stable: tied logits keep their vocabulary order, so top_k 1 picks what argmax (greedy) picks.
    scaled = logits / _cached(params, "temperature")
    ordered, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
    vocab = ordered.shape[-1]
    positions = torch.arange(vocab, device=logits.device)[None, :]
    ordered = ordered.masked_fill(positions >= _cached(params, "top_k")[:, None], float("-inf"))
    probs = torch.softmax(ordered, dim=-1)
    top_p = _cached(params, "top_p")
    # Keep the smallest prefix whose mass reaches top_p (always at least the first token).
    probs = probs.masked_fill(torch.cumsum(probs, dim=-1) - probs >= top_p[:, None], 0.0)
    probs = _min_p(probs, probs[:, :1], params["min_p"])
    return order.gather(1, _inverse_cdf(probs, u)[:, None])[:, 0]


def _min_p(probs: torch.Tensor, best: torch.Tensor, min_p: torch.Tensor | None) -> torch.Tensor:
    if min_p is None:
        return probs
    return probs.masked_fill(probs < min_p[:, None] * best, 0.0)


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One draw per row from its (unnormalised) probabilities with the row's own uniform number."""
    cdf = probs.double().cumsum(dim=-1)
    picks = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)
    return picks[:, 0].clamp_(max=probs.shape[-1] - 1)


def blocked_ids(eos_ids: Iterable[int], options: SamplingOptions) -> frozenset[int]:
    """Token ids that may not be drawn before ``min_tokens`` (EOS unless ignored, and stop ids)."""
    ids = set(options.stop_token_ids)
    if not options.ignore_eos:
        ids.update(eos_ids)
    return frozenset(ids)
