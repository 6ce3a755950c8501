"""The default model's CPU decode step, eager against ``torch.compile``d forms, and where its time goes.

Usage::

    python bench/bench_cpu_step.py --rows 1,8 --steps 40

Loads the default model as the worker does on the CPU (int4 weight-only layers, oneDNN for the
rest), runs decode steps through :class:`worker.model.runner.ModelRunner` (the paged attention
included), and times, in one process and one after the other: eager; ``pieces`` (each layer's MLP
and both RMSNorms compiled, so SiLU-mul and the norms fuse); ``layers`` (each decoder layer's
forward compiled, the paged attention left out of the graph as a custom call, the way vLLM splits
its graphs). Printed per form: compile time, median ms per step at each row count, eager / form.
Then a profile of the eager one-row step: the share of the weight-only matrix products.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))

import torch  # noqa: E402
from transformers import AttentionInterface  # noqa: E402

from worker.attention import paged  # noqa: E402
from worker.model.loader import load_model  # noqa: E402
from worker.model.runner import ModelRunner  # noqa: E402
from worker.model.step_inputs import Work  # noqa: E402

PROMPT = list(range(100, 160))  # 60 tokens in blocks 0-3 of each row's own 5 blocks


def step_ms(runner: ModelRunner, rows: int, steps: int) -> float:
    """Median ms of ``steps`` decode steps of ``rows`` rows (5 warm-up steps not counted)."""
    for row in range(rows):
        runner.execute([Work(PROMPT, 0, [5 * row + b for b in range(4)], True)])
    times = []
    for i in range(steps + 5):
        work = [
            Work([5 + row], len(PROMPT) + i, [5 * row + b for b in range(5)], True) for row in range(rows)
        ]
        started = time.perf_counter()
        runner.execute(work)
        times.append(time.perf_counter() - started)
    return statistics.median(times[5:]) * 1e3


def compile_pieces(model: Any) -> Callable[[], None]:
    """Compiles each layer's MLP and norms; returns the undo."""
    saved = []
    for layer in model.model.layers:
        for module in (layer.mlp, layer.input_layernorm, layer.post_attention_layernorm):
            saved.append((module, module.forward))
            module.forward = torch.compile(module.forward, dynamic=True)
    return lambda: [setattr(m, "forward", f) for m, f in saved] and None


def compile_layers(model: Any) -> Callable[[], None]:
    """Compiles each decoder layer with the paged attention outside the graphs; returns the undo."""
    AttentionInterface.register(paged.NAME, torch.compiler.disable(paged.paged_attention_forward))
    saved = [(layer, layer.forward) for layer in model.model.layers]
    for layer, forward in saved:
        layer.forward = torch.compile(forward, dynamic=True)

    def undo() -> None:
        for layer, forward in saved:
            layer.forward = forward
        AttentionInterface.register(paged.NAME, paged.paged_attention_forward)

    return undo


def matmul_share(runner: ModelRunner) -> tuple[float, float]:
    """The eager one-row step's profiled ms and the share spent in the weight-only matrix products."""
    from torch.profiler import ProfilerActivity, profile

    step_ms(runner, 1, 2)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step_ms(runner, 1, 10)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    products = sum(e.self_cpu_time_total for e in events if "pack_mm" in e.key or "linear" in e.key)
    return total / 15 / 1e3, products / total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--quantization", default="auto")
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    loaded = load_model(None, quantization=args.quantization)
    runner = ModelRunner(loaded, num_blocks=5 * max(rows) + 1, block_size=16)
    eager = {r: step_ms(runner, r, args.steps) for r in rows}
    print(f"{loaded.model_id}, {loaded.quantization}, {torch.get_num_threads()} threads")
    print("form     compile_s  " + "  ".join(f"{r:>3} rows ms (eager/form)" for r in rows))
    print("eager        -      " + "  ".join(f"{eager[r]:>8.1f}  (1.00x)      " for r in rows))
    for name, apply in (("pieces", compile_pieces), ("layers", compile_layers)):
        started = time.perf_counter()
        undo = apply(loaded.model)
        step_ms(runner, 1, 1)
        for r in rows:
            step_ms(runner, r, 1)  # the first calls compile
        compile_s = time.perf_counter() - started
        timed = {r: step_ms(runner, r, args.steps) for r in rows}
        cells = "  ".join(f"{timed[r]:>8.1f}  ({eager[r] / timed[r]:.2f}x)      " for r in rows)
        print(f"{name:<8} {compile_s:>7.1f}    {cells}")
        undo()
    profiled, share = matmul_share(runner)
    print(f"eager 1-row step under the profiler: {profiled:.1f} ms, {share:.0%} in the weight-only products")


if __name__ == "__main__":
    main()
