"""Linear-layer kernels: torch's default (MKL) against oneDNN-packed weights, on the default model.

Usage::

    python bench/bench_linear.py                 # rows 1,4,16,32, 5 rounds
    python bench/bench_linear.py --rows 16 --rounds 9

Runs every linear layer of the default model (SmolLM2-135M-Instruct, float32,
211 layers, 538 MB of weights), in model order, on a batch of R rows: once
with ``torch.nn.functional.linear`` on the plain weights and once with the
packed layers the worker uses (``worker/model/packed_linear.py``), alternating, and
prints each kernel's median milliseconds per pass and their ratio. That is the
matrix-product part of one decode step of R sequences; the weights are read
from memory each pass, as in a real step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from worker.model.loader import load_model
from worker.model.packed_linear import PackedLinear, packing_supported


def one_pass(layers: list, inputs: dict[int, torch.Tensor]) -> float:
    start = time.perf_counter()
    with torch.inference_mode():
        for layer in layers:
            layer(inputs[layer.in_features])
    return (time.perf_counter() - start) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", default="1,4,16,32")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not packing_supported(torch.float32):
        raise SystemExit("this torch build cannot pack weights for oneDNN")
    plain = [
        m for m in load_model(None, cpu_linear="torch").model.modules() if isinstance(m, torch.nn.Linear)
    ]
    size = sum(m.weight.numel() * m.weight.element_size() for m in plain) / 1e6
    print(f"{len(plain)} linear layers, {size:.0f} MB of float32 weights, {torch.get_num_threads()} threads")
    for rows in [int(r) for r in args.rows.split(",")]:
        packed = [PackedLinear(m, rows) for m in plain]
        inputs = {m.in_features: torch.randn(rows, m.in_features) for m in plain}
        for layers in (plain, packed):  # warm-up
            one_pass(layers, inputs)
        times: dict[str, list[float]] = {"torch": [], "onednn": []}
        for _ in range(args.rounds):
            times["torch"].append(one_pass(plain, inputs))
            times["onednn"].append(one_pass(packed, inputs))
        torch_ms, onednn_ms = statistics.median(times["torch"]), statistics.median(times["onednn"])
        print(
            f"rows {rows:>3}: torch (MKL) {torch_ms:6.1f} ms  onednn packed {onednn_ms:6.1f} ms  "
            f"speed-up {torch_ms / onednn_ms:.2f}x",
            flush=True,
        )


if __name__ == "__main__":
    main()
