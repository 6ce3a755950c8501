"""Several serving processes (``--api-server-count``) against one, in one run: tokens/s and the CPU
per 1,000 streamed tokens of each of the worker's processes at many streams, with the fake device.

Usage::

    python bench/bench_serving_processes.py          # the engine in process, then 1 and 2 serving
    python bench/bench_serving_processes.py --counts 1,2,3 --concurrency 64,256 --rounds 3

Per count N, one ``--fake-tokens`` worker (``--fake-step-ms``: a sleep per step that releases the
GIL, like a GPU forward; ``--fake-vocab 64``; ``--max-running 256``) with its engine in its own
process and N serving processes (N = 1 is ``--engine-process`` alone; N = 0 the engine in the
serving process, the default), and an edge with N processes (at least one) in front of it.
Paths: ``direct`` (``GenerateStreams`` calls spread over ``--connections`` client connections,
which the kernel spreads over the serving processes) and ``edge`` (light SSE readers; each edge
process with ``--worker-connections`` as many). Per level
and round the paths are measured in turn, the order rotating by round, each a window of
``--seconds`` (``bench_edge_overhead.measure``). Printed per path: tokens/s, the worker's CPU ms
per 1,000 tokens split into its first serving process, its other serving processes and its engine
process, the edge's, and their sum; medians with the rounds' spread.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import sys
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
# Fresh processes, not the tests' zygote: a zygote forks the engine process itself, outside the
# worker's process tree, whose CPU this splits by process.
os.environ["SLUICE_TEST_ZYGOTE"] = "0"
sys.path.insert(0, str(REPO / "bench"))

from bench_edge_overhead import (  # noqa: E402
    Measurement,
    SseReader,
    StreamOnce,
    content_bytes_per_token,
    measure,
    parse_list,
    pid_of,
)
from bench_multiplexed import FAKE_VOCAB, direct, measure_rounds, via_edge  # noqa: E402

from sluice.client import WorkerClient  # noqa: E402
from tests.processes import EdgeProcess, WorkerProcess  # noqa: E402
from worker.config import DEFAULT_CACHE_DIR  # noqa: E402


def worker_pids(worker: WorkerProcess) -> dict[str, list[int]]:
    """The worker's engine process and its serving processes beyond the first, from its log."""
    log = worker.log_path.read_text(errors="replace")
    engine = re.search(r"the engine runs in its own process \(pid (\d+)\)", log)
    others = re.search(r"more serving processes on the port \(pids \[([\d, ]+)\]\)", log)
    return {
        "engine": [int(engine.group(1))] if engine else [],
        "other serving": [int(pid) for pid in others.group(1).split(",")] if others else [],
    }


@contextmanager
def stacks(args: argparse.Namespace, logs: Path) -> Iterator[dict[int, tuple[WorkerProcess, EdgeProcess]]]:
    """Per count, a worker with that many serving processes and an edge with as many processes."""
    fake = ["--fake-tokens", "--fake-step-ms", str(args.step_ms), "--fake-vocab", str(FAKE_VOCAB)]
    with ExitStack() as stack:
        started = {}
        for count in args.counts:
            (logs / f"worker-{count}").mkdir()
            (logs / f"edge-{count}").mkdir()
            extra = [*fake, "--max-running", str(args.max_running), "--max-queue", "4096"]
            own = ["--engine-process", "--api-server-count", str(count)] if count else []
            worker = WorkerProcess(
                cache_dir=args.cache_dir, log_dir=logs / f"worker-{count}", extra=[*extra, *own]
            )
            stack.enter_context(worker)
            flags = ["--processes", str(max(1, count)), "--worker-connections", str(args.connections)]
            edge = EdgeProcess([worker.address], log_dir=logs / f"edge-{count}", extra=flags)
            started[count] = (worker, stack.enter_context(edge))
        yield started


def ms_per_1000(m: Measurement, names: list[str], bytes_per_token: float) -> float:
    tokens = m.tokens(bytes_per_token)
    return 1e6 * sum(m.cpu[name] for name in names) / tokens if tokens else float("nan")


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.0f} ({min(values):.0f}-{max(values):.0f})"


def row(level: int, path: str, ms: list[Measurement], bytes_per_token: float) -> str:
    """One table line: the worker's CPU split by process (the first serving process is the tree's
    total less the others), the edge's when the path goes through it."""
    others = [n for n in ms[0].cpu if n.startswith(f"{path.split()[0]} other")]
    engine = [n for n in ms[0].cpu if n.startswith(f"{path.split()[0]} engine")]
    tree = [f"{path.split()[0]} worker"]
    total = [ms_per_1000(m, tree, bytes_per_token) for m in ms]
    other = [ms_per_1000(m, others, bytes_per_token) for m in ms]
    eng = [ms_per_1000(m, engine, bytes_per_token) for m in ms]
    first = [t - o - e for t, o, e in zip(total, other, eng, strict=True)]
    edge = [ms_per_1000(m, [f"{path.split()[0]} edge"], bytes_per_token) for m in ms]
    through_edge = path.endswith("edge")
    both = [t + (d if through_edge else 0.0) for t, d in zip(total, edge, strict=True)]
    rate = [m.tokens_per_s(bytes_per_token) for m in ms]
    return (
        f"| {level} | {path} | {spread(rate)} | {spread(first)} | {spread(other) if others else '-'} "
        f"| {spread(eng)} | {spread(total)} | {spread(edge) if through_edge else '-'} | {spread(both)} "
        f"| {sum(m.errors for m in ms)} |"
    )


async def run(args: argparse.Namespace, started: dict[int, tuple[WorkerProcess, EdgeProcess]]) -> list[str]:
    once: dict[str, StreamOnce] = {}
    pids: dict[str, dict[str, int]] = {}
    clients: list[WorkerClient] = []
    readers: list[dict[int, SseReader]] = []
    users = max(args.concurrency)
    for count, (worker, edge) in started.items():
        own = [WorkerClient(worker.address) for _ in range(args.connections)]
        clients += own
        streams = [direct(client, True, args.max_tokens) for client in own]

        async def spread_over(index: int, counts, streams=streams) -> None:  # type: ignore[no-untyped-def]
            await streams[index % len(streams)](index, counts)

        label = f"x{count}" if count else "in-process"
        once[f"{label} direct"] = spread_over
        readers.append({})
        once[f"{label} edge"] = via_edge(edge, readers[-1], users, args.max_tokens)
        found = worker_pids(worker)
        named = {f"{label} worker": pid_of(worker), f"{label} edge": pid_of(edge)}
        named |= {f"{label} engine": pid for pid in found["engine"]}
        named |= {f"{label} other {i}": pid for i, pid in enumerate(found["other serving"], start=1)}
        pids[label] = named
    every = {name: pid for named in pids.values() for name, pid in named.items()} | {"client": os.getpid()}
    workers = [worker for worker, _ in started.values()]
    paths = list(once)
    for path in paths:  # warm every path (connections, first calls)
        await measure(path, once[path], 4, 0.5, every, workers)
    bytes_per_token = await content_bytes_per_token(clients[:1], args.max_tokens)
    lines = [
        f"worker: --fake-step-ms {args.step_ms:g} --fake-vocab {FAKE_VOCAB} --max-running {args.max_running}"
        f" --engine-process --api-server-count N; {args.connections} direct connections; max_tokens "
        f"{args.max_tokens}; {args.rounds} rounds of {args.seconds:g} s; medians (min-max)",
        "| streams | path | tok/s | first serving ms / 1000 tokens | other serving | engine | worker "
        "| edge | sum | errors |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for level in args.concurrency:

        def described(path: str, m: Measurement) -> str:
            return f"{m.tokens_per_s(bytes_per_token):.0f} tok/s, {m.errors} errors"

        runs = await measure_rounds(level, paths, once, args, every, workers, described)
        lines += [row(level, path, runs[path], bytes_per_token) for path in paths]
    for client in clients:
        await client.close()
    for group in readers:
        for reader in group.values():
            await reader.close()
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--counts",
        default="0,1,2",
        help="comma-separated --api-server-count values (0: the engine in process)",
    )
    parser.add_argument("--concurrency", default="256", help="comma-separated stream counts")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=4.0, help="length of one measurement window")
    parser.add_argument("--connections", type=int, default=8, help="direct client connections per worker")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--step-ms", type=float, default=10.0)
    parser.add_argument("--max-running", type=int, default=256)
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR)
    args = parser.parse_args(argv)
    try:
        args.counts = [int(c) for c in parse_list(int, args.counts)]
        args.concurrency = [int(c) for c in parse_list(int, args.concurrency)]
    except ValueError as exc:
        parser.error(f"--counts and --concurrency take comma-separated numbers: {exc}")
    if not args.counts or min(args.counts) < 0 or not args.concurrency or min(args.concurrency) < 1:
        parser.error("--counts and --concurrency need values >= 1")
    if args.rounds < 1 or args.seconds <= 0 or args.connections < 1:
        parser.error("--rounds and --connections must be at least 1, --seconds positive")
    with tempfile.TemporaryDirectory(prefix="bench-serving-") as logs, stacks(args, Path(logs)) as started:
        lines = asyncio.run(run(args, started))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
