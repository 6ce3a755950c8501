"""What ``--batch-invariant`` costs: engine steps of the default model with and without it.

Loads the default model twice (``--quantization``, int4 by default; batch-invariant steps need
int4 or int8), builds one runner over each, and times, alternately over ``--rounds`` rounds: a
prompt of ``--prompt`` tokens in one step, and decode steps of 1 and ``--rows`` rows at a
context of ``--context`` tokens. Prints milliseconds per step (median over rounds) and the
ratio invariant / default, and checks that a decode row gives the same bits alone and beside
other rows in the invariant runner.

    python bench/bench_batch_invariant.py
    python bench/bench_batch_invariant.py --rows 16 --prompt 1024 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from worker.model.loader import load_model  # noqa: E402
from worker.model.runner import ModelRunner  # noqa: E402
from worker.model.step_inputs import Work  # noqa: E402

BLOCK = 16


def table(seq: int, blocks: int) -> list[int]:
    return list(range(seq * blocks, (seq + 1) * blocks))


def timed(run, repeat: int) -> float:  # type: ignore[no-untyped-def]
    started = time.perf_counter()
    for _ in range(repeat):
        run()
    return (time.perf_counter() - started) / repeat * 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quantization", default="int4", choices=("int4", "int8"))
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    per_seq = -(-(max(args.prompt, args.context) + 64) // BLOCK)
    blocks = per_seq * (args.rows + 2)
    runners = {
        name: ModelRunner(
            load_model(None, quantization=args.quantization),
            num_blocks=blocks,
            block_size=BLOCK,
            batch_invariant=name == "invariant",
        )
        for name in ("default", "invariant")
    }
    prompt = [100 + i % 1000 for i in range(args.prompt)]
    context = [200 + i % 1000 for i in range(args.context)]
    for runner in runners.values():  # every row's context in the pool (and the kernels warm)
        for seq in range(args.rows):
            runner.execute([Work(context, 0, table(seq, per_seq), True)])

    def decode(runner: ModelRunner, rows: int) -> None:
        runner.execute([Work([5], args.context, table(seq, per_seq), True) for seq in range(rows)])

    figures: dict[tuple[str, str], list[float]] = {}
    cases = {
        f"prompt of {args.prompt}": lambda r: timed(
            lambda: r.execute([Work(prompt, 0, table(args.rows, per_seq), True)]), 1
        ),
        "decode, 1 row": lambda r: timed(lambda: decode(r, 1), 10),
        f"decode, {args.rows} rows": lambda r: timed(lambda: decode(r, args.rows), 5),
    }
    for _ in range(args.rounds):
        for case, measure in cases.items():
            for name, runner in runners.items():
                figures.setdefault((case, name), []).append(measure(runner))
    print(f"default model, {args.quantization}, {args.threads} threads, medians of {args.rounds} rounds")
    print(f"{'step':<22} {'default ms':>11} {'invariant ms':>13} {'ratio':>6}")
    for case in cases:
        default = statistics.median(figures[(case, "default")])
        invariant = statistics.median(figures[(case, "invariant")])
        print(f"{case:<22} {default:>11.1f} {invariant:>13.1f} {invariant / default:>6.2f}")
    runner = runners["invariant"]
    alone = runner.execute([Work([5], args.context, table(0, per_seq), True)])[0]
    crowded = runner.execute([Work([5], args.context, table(seq, per_seq), True) for seq in range(args.rows)])
    same = torch.equal(alone, crowded[0])
    print(f"invariant runner: a row alone and beside {args.rows - 1} others give the same bits: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
