"""Executes the model: the only module that runs torch forward passes.

The runner owns the running batch's KV cache (:class:`BatchCache`) and the
mapping from sequence keys to its rows. Call order per engine step:

1. ``release`` the sequences that left (finished or aborted);
2. ``prefill`` the newly admitted prompts in one forward, then ``admit`` one
   row per choice (an ``n``-choice request shares its prompt's prefill);
3. ``decode`` every row one token in one forward.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch

from worker.batch_cache import BatchCache, prefill_inputs
from worker.model_loader import LoadedModel

# A batch row belongs to one choice of one request: (engine request key, choice index).
RowKey = tuple[str, int]


class ModelRunner:
    def __init__(self, loaded: LoadedModel):
        self.model = loaded.model
        self.device = loaded.device
        self.dtype = loaded.dtype
        self.num_layers = int(loaded.model.config.num_hidden_layers)
        pad = loaded.tokenizer.pad_token_id
        self.pad_id = int(pad) if pad is not None else 0
        self._batch = BatchCache(self.num_layers)
        self._rows: list[RowKey] = []

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
        """Runs the prompts in one left-padded forward.

        Returns the logits of each prompt's last position [m, vocab] and the prompts' cache.
        """
        ids, positions, mask = prefill_inputs(prompts, self.pad_id, self.dtype, self.device)
        cache = BatchCache(self.num_layers)
        cache.lengths = [len(p) for p in prompts]
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1].float().cpu(), cache

    def admit(self, prefilled: BatchCache, rows: Sequence[tuple[int, RowKey]]) -> None:
        """Adds one batch row per (prompt index in ``prefilled``, sequence key)."""
        self._batch.append(prefilled, [index for index, _ in rows])
        self._rows += [key for _, key in rows]

    @torch.inference_mode()
    def decode(self, last_tokens: Mapping[RowKey, int]) -> torch.Tensor:
        """Advances every row by its last token; returns logits [rows, vocab] in ``row_keys`` order."""
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
        return out.logits[:, -1].float().cpu()

    def release(self, keys: Iterable[RowKey]) -> None:
        """Drops the rows of these sequences (unknown keys are ignored)."""
        gone = set(keys)
        if not gone.intersection(self._rows):
            return
        keep = [i for i, key in enumerate(self._rows) if key not in gone]
        self._batch.keep(keep)
        self._rows = [self._rows[i] for i in keep]

    def reset(self) -> None:
        """Drops every row (after a failed step, whose cache state is unknown)."""
        self._batch = BatchCache(self.num_layers)
        self._rows = []
