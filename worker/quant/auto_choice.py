"""``--quantization auto`` on the CPU: int4 or int8, chosen by timing a decode pass through the
model's own MLP shapes and layer count on this host at start-up (a fraction of a second), not by a
constant from another machine. Design notes: docs/worker.md ("Quantization auto on the CPU")."""

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

REPEATS = 3  # the best of three passes
# The most int8 weight bytes one scheme's pass reads: enough to leave every core's own cache (one
# layer's weights stay in it and time the kernels' arithmetic, not the memory a decode step reads),
# small enough to build in tens of milliseconds for any model.
PASS_BYTES = 128 << 20
# Bump when the way of measuring changes, so figures kept by an older worker are measured again.
METHOD = "decode-pass"


@dataclass(frozen=True)
class ModelShapes:
    """One decoder layer's MLP ``(out, in)`` shapes and the model's layer count."""

    linears: tuple[tuple[int, int], ...] = ()
    layers: int = 1


@dataclass(frozen=True)
class Measured:
    """Each scheme's seconds for one pass through ``layers`` layers' shapes, at one row and at the
    decode batch."""

    seconds: dict[str, float]
    rows: tuple[int, ...]
    took: float  # the measurement's own wall time
    layers: int = 1

    @property
    def choice(self) -> str:
        return min(self.seconds, key=lambda scheme: self.seconds[scheme])

    def describe(self) -> str:
        figures = ", ".join(f"{scheme} {1e3 * s:.3f} ms" for scheme, s in sorted(self.seconds.items()))
        rows = " and ".join(str(r) for r in self.rows)
        took = f"{1e3 * self.took:.0f} ms"
        return (
            f"measured on this host through {self.layers} layers of the model's MLP shapes, {rows} rows: "
            f"{figures}; took {took}"
        )


def _best_of(product: Callable[[], object]) -> float:
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


def _scheme_seconds(
    scheme: str, shapes: Sequence[tuple[int, int]], layers: int, rows: Sequence[int]
) -> float:
    """``layers`` copies of one ``scheme`` layer per ``(out, in)`` shape, multiplied in order as a
    decode step reads them (one pass to warm up, then the best of :data:`REPEATS`) at each row count."""
    stack = [
        _layer(scheme, out_features, in_features)
        for _ in range(layers)
        for out_features, in_features in shapes
    ]
    total = 0.0
    for count in rows:
        inputs = {in_features: torch.full((count, in_features), 0.5) for _, in_features in shapes}

        def decode_pass(inputs: dict[int, torch.Tensor] = inputs) -> None:
            for layer in stack:
                layer(inputs[layer.in_features])

        decode_pass()  # the first pass pays the kernels' one-time setup
        total += _best_of(decode_pass)
    return total


def pass_layers(shapes: ModelShapes) -> int:
    """How many of the model's layers a pass reads: all of them, or as many as :data:`PASS_BYTES`
    of int8 weights hold (at least one)."""
    per_layer = sum(out_features * in_features for out_features, in_features in shapes.linears)
    return max(1, min(shapes.layers, PASS_BYTES // max(per_layer, 1)))


@torch.no_grad()
def measure(shapes: ModelShapes, batch_hint: int) -> Measured:
    """Times int4 and int8 decode passes through one decoder layer's MLP products repeated for the
    model's layers (:func:`pass_layers`), for one row and for ``batch_hint`` rows
    (clipped to the rows below :data:`BATCH_ROWS`: from there on both schemes multiply with the same
    float16 batch copy, so only these differ). One layer's weights alone stay in a core's cache and
    time the arithmetic: on a 2-core Xeon that favoured int8 (0.26 against 0.29 ms) while int4, which
    reads half the bytes, decoded 1.3x faster at one stream."""
    started = time.perf_counter()
    rows = tuple(sorted({1, min(batch_hint, BATCH_ROWS - 1)}))
    count = pass_layers(shapes)
    seconds = {scheme: _scheme_seconds(scheme, shapes.linears, count, rows) for scheme in ("int4", "int8")}
    return Measured(seconds, rows, time.perf_counter() - started, count)


def model_shapes(config: object) -> ModelShapes:
    """A transformers config's decoder MLP projections (gate, up and down: most of a layer's
    weights; the output layer is int8 either way) and its layer count."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = int(getattr(text, "hidden_size", 0) or 0)
    inner = int(getattr(text, "intermediate_size", 0) or 0) or 4 * hidden
    shapes = [(inner, hidden), (inner, hidden), (hidden, inner)] if hidden else []
    # The int4 layers' own limits (quantize_weight serves int8 elsewhere): whole groups, 16-row packs.
    linears = tuple((o, i) for o, i in shapes if i % INT4_GROUP == 0 and o % 16 == 0)
    return ModelShapes(linears, max(1, int(getattr(text, "num_hidden_layers", 1) or 1)))


def measure_once(shapes: ModelShapes, batch_hint: int, cache: Path | None) -> Measured:
    """:func:`measure`, kept in ``cache`` per shapes, layers, method and torch version: the first
    worker on a host to measure decides for every later one (workers that resume each other's
    streams must agree, and two measurements on a busy host may differ). The first file written wins
    a race."""
    if cache is None:
        return measure(shapes, batch_hint)
    named = [[list(shape) for shape in shapes.linears], shapes.layers, batch_hint, METHOD, torch.__version__]
    key = hashlib.sha256(json.dumps(named).encode()).hexdigest()[:12]
    path = cache / f"quantization-auto-{key}.json"
    if not path.is_file():
        measured = measure(shapes, batch_hint)
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=cache, delete=False, suffix=".part") as staging:
            figures = {"seconds": measured.seconds, "rows": measured.rows, "took": measured.took}
            json.dump(figures | {"layers": measured.layers}, staging)
        try:
            os.link(staging.name, path)  # fails where another worker's figures are already there
        except FileExistsError:
            pass
        finally:
            os.unlink(staging.name)
    saved = json.loads(path.read_text())
    return Measured(saved["seconds"], tuple(saved["rows"]), saved["took"], saved["layers"])
