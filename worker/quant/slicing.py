"""A tensor-parallel rank's cut of a quantized layer as the loaders read it (the :class:`Slicer` that
worker/parallel/quantized_shards.py implements), and :data:`WHOLE`, one rank's: every layer whole.
Design notes: docs/worker.md, "Tensor parallelism"."""

from __future__ import annotations

from typing import Protocol

import torch

Tensor = torch.Tensor


class Slicer(Protocol):
    """A tensor-parallel rank's share of each quantized layer (``path``), cut from the checkpoint's
    codes and scales in their [out, in] form before the layer packs them
    (worker/parallel/quantized_shards.py); the int4 scales and offsets are [groups, out]."""

    def int4(
        self, path: str, q: Tensor, scale: Tensor, zero: Tensor, g_idx: Tensor | None, group: int
    ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]: ...

    def per_row(self, path: str, weight: Tensor, scale: Tensor) -> tuple[Tensor, Tensor]: ...

    def blocks(
        self, path: str, weight: Tensor, scale: Tensor, block: tuple[int, int], input_group: int
    ) -> tuple[Tensor, Tensor, tuple[int, int]]: ...

    def bias(self, path: str, bias: Tensor) -> Tensor: ...


class Whole:
    """The :class:`Slicer` of one rank: every layer whole."""

    def int4(
        self, path: str, q: Tensor, scale: Tensor, zero: Tensor, g_idx: Tensor | None, group: int
    ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        return q, scale, zero, g_idx

    def per_row(self, path: str, weight: Tensor, scale: Tensor) -> tuple[Tensor, Tensor]:
        return weight, scale

    def blocks(
        self, path: str, weight: Tensor, scale: Tensor, block: tuple[int, int], input_group: int
    ) -> tuple[Tensor, Tensor, tuple[int, int]]:
        return weight, scale, block

    def bias(self, path: str, bias: Tensor) -> Tensor:
        return bias


WHOLE = Whole()
