"""``--quantization auto`` on the CPU: int4 or int8, chosen by timing both layers' products at the
model's own shapes on this host at start-up (a few milliseconds), not by a constant from another machine.
Design notes: docs/worker.md ("Quantization auto on the CPU")."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from worker.quant.layers import BATCH_ROWS, INT4_GROUP, Int4Linear, Int8Linear

REPEATS = 3  # the best of three: one product at these sizes takes tens of microseconds


@dataclass(frozen=True)
class Measured:
    """Each scheme's seconds for one product per shape, at one row and at the decode batch."""

    seconds: dict[str, float]
    rows: tuple[int, ...]
    took: float  # the measurement's own wall time

    @property
    def choice(self) -> str:
        return min(self.seconds, key=lambda scheme: self.seconds[scheme])

    def describe(self) -> str:
        figures = ", ".join(f"{scheme} {1e3 * s:.3f} ms" for scheme, s in sorted(self.seconds.items()))
        rows = " and ".join(str(r) for r in self.rows)
        took = f"{1e3 * self.took:.0f} ms"
        return f"measured on this host at the model's shapes, {rows} rows: {figures}; took {took}"


def _best_of(product: Callable[[], torch.Tensor]) -> float:
    best = float("inf")
    for _ in range(REPEATS):
        started = time.perf_counter()
        product()
        best = min(best, time.perf_counter() - started)
    return best


def _layer(scheme: str, out_features: int, in_features: int) -> Int4Linear | Int8Linear:
    """A ``scheme`` layer of that shape built straight from constant codes (the kernels' time does not
    depend on the values, and drawing a million random ones costs more than every product here)."""
    if scheme == "int8":
        codes = torch.ones(out_features, in_features, dtype=torch.int8)
        return Int8Linear(codes, torch.full((out_features,), 0.01), batch_copy=False)
    codes = torch.full((out_features, in_features), 9, dtype=torch.int32)
    scale = torch.full((in_features // INT4_GROUP, out_features), 0.01)
    return Int4Linear(codes, scale, torch.zeros_like(scale), batch_copy=False)


def _scheme_seconds(scheme: str, shapes: Sequence[tuple[int, int]], rows: Sequence[int]) -> float:
    """One ``scheme`` layer per ``(out, in)`` shape, each multiplied (once to warm up, then timed)
    at each row count."""
    total = 0.0
    for out_features, in_features in shapes:
        layer = _layer(scheme, out_features, in_features)
        for count in rows:
            x = torch.full((count, in_features), 0.5)
            layer(x)  # the first call pays the kernel's one-time setup
            total += _best_of(lambda layer=layer, x=x: layer(x))  # type: ignore[misc]
    return total


@torch.no_grad()
def measure(shapes: Sequence[tuple[int, int]], batch_hint: int) -> Measured:
    """Times int4 and int8 products at ``shapes`` (the model's distinct linear shapes) on the 4/8-bit
    kernels, for one row and for ``batch_hint`` rows (clipped to the rows below :data:`BATCH_ROWS`:
    from there on both schemes multiply with the same float16 batch copy, so only these differ)."""
    started = time.perf_counter()
    rows = tuple(sorted({1, min(batch_hint, BATCH_ROWS - 1)}))
    seconds = {scheme: _scheme_seconds(scheme, shapes, rows) for scheme in ("int4", "int8")}
    return Measured(seconds, rows, time.perf_counter() - started)


def linear_shapes(config: object) -> list[tuple[int, int]]:
    """The ``(out, in)`` shapes of a decoder layer's MLP projections (up and down: two thirds of its
    weights), from a transformers config; the output layer is int8 either way."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = int(getattr(text, "hidden_size", 0) or 0)
    inner = int(getattr(text, "intermediate_size", 0) or 0) or 4 * hidden
    shapes = [(inner, hidden), (hidden, inner)] if hidden else []
    # The int4 layers' own limits (quantize_weight serves int8 elsewhere): whole groups, 16-row packs.
    return [(o, i) for o, i in shapes if i % INT4_GROUP == 0 and o % 16 == 0]


def measure_once(shapes: Sequence[tuple[int, int]], batch_hint: int, cache: Path | None) -> Measured:
    """:func:`measure`, kept in ``cache`` per shapes and torch version: the first worker on a host
    to measure decides for every later one (workers that resume each other's streams must agree,
    and two measurements on a busy host may differ). The first file written wins a race."""
    if cache is None:
        return measure(shapes, batch_hint)
    key = hashlib.sha256(json.dumps([list(shapes), batch_hint, torch.__version__]).encode()).hexdigest()[:12]
    path = cache / f"quantization-auto-{key}.json"
    if not path.is_file():
        measured = measure(shapes, batch_hint)
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=cache, delete=False, suffix=".part") as staging:
            json.dump({"seconds": measured.seconds, "rows": measured.rows, "took": measured.took}, staging)
        try:
            os.link(staging.name, path)  # fails where another worker's figures are already there
        except FileExistsError:
            pass
        finally:
            os.unlink(staging.name)
    saved = json.loads(path.read_text())
    return Measured(saved["seconds"], tuple(saved["rows"]), saved["took"])
