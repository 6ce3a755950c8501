"""Streams surviving their worker's death: the issue's bar, with figures.

Two workers serving the default model behind one edge (real processes on
127.0.0.1). ``--streams`` greedy streams of ``--max-tokens`` tokens run once
undisturbed, then again all on worker A, which is SIGKILLed mid-stream (see
``tests/migration_scenario.py``). Prints, per stream: whether its text equals
the undisturbed run's, its finish reason and completion tokens, and how long
its output stalled around the kill (the move to worker B: the edge noticing
the broken call, B prefilling prompt plus the tokens so far); then the edge's
``sluice_edge_stream_migrations_total`` by outcome. Exit status 0 when every
stream ended normally with its undisturbed text.

    python bench/bench_migration.py                 # the bar: 6 streams of 400 tokens
    python bench/bench_migration.py --kill-after-chunks 150   # A dies with ~half of each stream sent
    python bench/bench_migration.py --batch-invariant off     # the default steps, for comparison
    python bench/bench_migration.py --streams 2 --max-tokens 60
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.migration_scenario import EDGE_FLAGS, kill_under_streams  # noqa: E402
from tests.processes import EdgeProcess, WorkerProcess  # noqa: E402
from worker.config import DEFAULT_CACHE_DIR  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument("--cache-dir", default=str(DEFAULT_CACHE_DIR))
    parser.add_argument(
        "--kill-after-chunks",
        type=int,
        default=0,
        help="kill worker A only once every stream read this many content chunks (0: at once)",
    )
    parser.add_argument(
        "--batch-invariant",
        choices=("on", "off"),
        default="on",
        help="the workers' --batch-invariant (on: the texts must match bit for bit; off: the default "
        "steps, where a near-tie after the move can pick another token)",
    )
    parser.add_argument("--worker-args", default="", help="more worker flags, e.g. '--quantization none'")
    args = parser.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="sluice-migration-"))
    workers = []
    for worker_id in ("A", "B"):
        (logs / worker_id).mkdir()
        extra = ["--worker-id", worker_id, "--max-running", str(max(8, args.streams))]
        extra += ["--batch-invariant", args.batch_invariant, *args.worker_args.split()]
        workers.append(WorkerProcess(cache_dir=Path(args.cache_dir), log_dir=logs / worker_id, extra=extra))
    a, b = workers
    for worker in workers:
        worker.launch()
    try:
        for worker in workers:
            worker.wait_ready()
        with EdgeProcess([a.address, b.address], log_dir=logs, extra=EDGE_FLAGS) as edge:
            result = asyncio.run(
                kill_under_streams(
                    edge,
                    a,
                    b,
                    args.streams,
                    args.max_tokens,
                    ignore_eos=True,
                    kill_after_chunks=args.kill_after_chunks,
                )
            )
    finally:
        for worker in workers:
            worker.stop()
    ok = True
    stalls = []
    print(f"{args.streams} greedy streams of up to {args.max_tokens} tokens, worker A SIGKILLed mid-stream")
    print("stream  same text  finish  tokens  chunks before kill  stall around kill (s)")
    for i, (before, after) in enumerate(zip(result.undisturbed, result.disturbed, strict=True)):
        same = before.text == after.text and before.completion_tokens == after.completion_tokens
        complete = after.finish_reason is not None and after.completion_tokens is not None
        ok = ok and same and complete
        stall = result.stall_after_kill(i)
        if stall is not None:
            stalls.append(stall)
        killed_after = sum(1 for t in after.arrivals if t <= result.killed_at)
        stall_text = f"{stall:.2f}" if stall is not None else "-"
        print(
            f"{i:>6}  {'yes' if same else 'NO':>9}  {after.finish_reason!s:>6}  "
            f"{after.completion_tokens!s:>6}  {killed_after:>18}  {stall_text:>21}"
        )
    if stalls:
        print(f"stall around the kill: median {statistics.median(stalls):.2f} s, max {max(stalls):.2f} s")
    print(f"edge migrations by outcome: {result.migrations}")
    print(f"logs: {logs}")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
