"""Executes the model: the only module that runs torch forward passes.

The runner owns the running batch's KV cache (:class:`BatchCache`) and the
mapping from sequence keys to its rows. Call order per engine step:

1. ``release`` the sequences that left (finished or aborted);
2. ``prefill`` the newly admitted prompts in one forward, then ``admit`` one
   row per choice (an ``n``-choice request shares its prompt's prefill);
3. ``decode`` every row one token in one forward.

With a prefix cache (``prefix_cache_tokens`` > 0), ``prefill`` first reuses
the stored KV of each prompt's longest cached prefix and runs the model on the
rest only; prompts of one prefill that share an uncached prefix get it computed
once, just before. Every prefilled prompt's whole blocks are then stored.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

import torch

from worker.batch_cache import BatchCache, compact, from_prefixes, prefill_inputs, suffix_prefill_inputs
from worker.model_loader import LoadedModel
from worker.prefix_cache import PrefixCache
from worker.types import SampledLogprobs

# A batch row belongs to one choice of one request: (engine request key, choice index).
RowKey = tuple[str, int]


class ModelRunner:
    scores_prompts = True  # ``score`` works (a runner without a model says False)

    def __init__(self, loaded: LoadedModel, *, prefix_cache_tokens: int = 0):
        self.model = loaded.model
        self.device = loaded.device
        self.dtype = loaded.dtype
        self.num_layers = int(loaded.model.config.num_hidden_layers)
        pad = loaded.tokenizer.pad_token_id
        self.pad_id = int(pad) if pad is not None else 0
        self._batch = BatchCache(self.num_layers)
        self._rows: list[RowKey] = []
        self.prefix_cache = PrefixCache(prefix_cache_tokens)

    @property
    def row_keys(self) -> list[RowKey]:
        """Sequence keys in row order (the order of ``decode``'s logits)."""
        return list(self._rows)

    @property
    def live_rows(self) -> int:
        return len(self._rows)

    @property
    def cache_tokens(self) -> int:
        """Tokens held in the batch's KV cache (padding not counted)."""
        return sum(self._batch.lengths)

    @property
    def cache_bytes(self) -> int:
        """Bytes allocated for the batch's KV cache (padding and headroom included)."""
        return self._batch.allocated_bytes

    @torch.inference_mode()
    def prefill(self, prompts: Sequence[Sequence[int]]) -> tuple[torch.Tensor, BatchCache]:
        """Runs the prompts in one left-padded forward (after one for their shared prefixes, if any).

        Returns the logits of each prompt's last position [m, vocab] and the prompts' cache, whose
        ``prefix_lengths`` say how many tokens of each prompt came from the prefix cache.
        """
        if not self.prefix_cache.enabled:
            return self._forward(prompts, [0] * len(prompts), [])
        shared = self._shared_prefixes(prompts)
        if shared:
            self._prefill_cached(shared)
        return self._prefill_cached(prompts)

    def _shared_prefixes(self, prompts: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
        """Whole-block prefixes that two or more of these prompts start with and that the cache
        lacks: computing each once beats computing it in every row. The longest per prompt."""
        size = self.prefix_cache.block_tokens
        seen: Counter[tuple[int, ...]] = Counter()
        for prompt in prompts:
            seen.update(tuple(prompt[:end]) for end in range(size, len(prompt), size))
        wanted: set[tuple[int, ...]] = set()
        for prompt in prompts:
            ends = [end for end in range(size, len(prompt), size) if seen[tuple(prompt[:end])] > 1]
            if ends and self.prefix_cache.cached_length(prompt) < ends[-1]:
                wanted.add(tuple(prompt[: ends[-1]]))
        return sorted(wanted)

    def _prefill_cached(self, prompts: Sequence[Sequence[int]]) -> tuple[torch.Tensor, BatchCache]:
        hits = [self.prefix_cache.lookup(prompt) for prompt in prompts]
        logits, cache = self._forward(prompts, [n for n, _ in hits], [layers for _, layers in hits])
        width = cache.width
        for row, prompt in enumerate(prompts):
            start = width - len(prompt)
            self.prefix_cache.store(
                prompt,
                [
                    (layer.buffer_k[row, :, start:width], layer.buffer_v[row, :, start:width])
                    for layer in cache._layers()
                    if layer.buffer_k is not None and layer.buffer_v is not None
                ],
            )
        return logits, cache

    def _forward(
        self,
        prompts: Sequence[Sequence[int]],
        prefix_lengths: list[int],
        prefixes: list[list[tuple[torch.Tensor, torch.Tensor]]],
    ) -> tuple[torch.Tensor, BatchCache]:
        """One prefill forward; rows with a prefix (its length and per-layer KV) compute the rest only."""
        if not any(prefix_lengths):
            ids, positions, mask = prefill_inputs(prompts, self.pad_id, self.dtype, self.device)
            cache = BatchCache(self.num_layers)
        else:
            ids, positions, mask = suffix_prefill_inputs(
                prompts, prefix_lengths, self.pad_id, self.dtype, self.device
            )
            cache = from_prefixes(prefixes, prefix_lengths, ids.shape[1])
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        if any(prefix_lengths):
            suffixes = [len(p) - n for p, n in zip(prompts, prefix_lengths, strict=True)]
            cache = compact(cache, prefix_lengths, suffixes)
        cache.lengths = [len(p) for p in prompts]
        cache.prefix_lengths = prefix_lengths
        return out.logits[:, -1].float(), cache

    @torch.inference_mode()
    def score(self, prompt: Sequence[int], top_n: int) -> list[SampledLogprobs]:
        """The logprob of each prompt token after the first given the tokens before it, with the
        ``top_n`` best alternatives, from one forward over the whole prompt (no cache kept, no prefix
        reused: every position needs its logits)."""
        ids = torch.tensor([list(prompt)], dtype=torch.long, device=self.device)
        logits = self.model(input_ids=ids, use_cache=False).logits[0, :-1].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        targets = ids[0, 1:]
        chosen = logprobs.gather(1, targets[:, None])[:, 0].tolist()
        top_values: list[list[float]] = [[] for _ in chosen]
        top_ids: list[list[int]] = [[] for _ in chosen]
        if top_n:
            values, indexes = torch.topk(logprobs, top_n, dim=-1)
            top_values, top_ids = values.tolist(), indexes.tolist()
        return [
            SampledLogprobs(int(token), value, tuple(alt_ids), tuple(alt_values))
            for token, value, alt_ids, alt_values in zip(prompt[1:], chosen, top_ids, top_values, strict=True)
        ]

    def admit(self, prefilled: BatchCache, rows: Sequence[tuple[int, RowKey]]) -> None:
        """Adds one batch row per (prompt index in ``prefilled``, sequence key)."""
        self._batch.append(prefilled, [index for index, _ in rows])
        self._rows += [key for _, key in rows]

    @torch.inference_mode()
    def decode(self, last_tokens: Mapping[RowKey, int]) -> torch.Tensor:
        """Advances every row by its last token; returns float32 logits [rows, vocab] in ``row_keys`` order,
        on the model's device (the sampler runs there)."""
        if set(last_tokens) != set(self._rows):
            raise RuntimeError("decode needs exactly one token for every row of the batch")
        ids = torch.tensor([[last_tokens[key]] for key in self._rows], dtype=torch.long, device=self.device)
        mask, positions = self._batch.decode_inputs(self.dtype, self.device)
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=self._batch,
            use_cache=True,
        )
        self._batch.advance()
        return out.logits[:, -1].float()

    def release(self, keys: Iterable[RowKey]) -> None:
        """Drops the rows of these sequences (unknown keys are ignored)."""
        gone = set(keys)
        if not gone.intersection(self._rows):
            return
        keep = [i for i, key in enumerate(self._rows) if key not in gone]
        self._batch.keep(keep)
        self._rows = [self._rows[i] for i in keep]

    def reset(self) -> None:
        """Drops every row of the batch (after a failed decode, whose cache state is unknown). The
        prefix cache stays: an entry is stored only after its prefill forward succeeded."""
        self._batch = BatchCache(self.num_layers)
        self._rows = []
