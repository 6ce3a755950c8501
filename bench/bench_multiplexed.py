"""GenerateStreams against Generate, in one run: CPU per 1,000 streamed tokens of the worker's and the
edge's process trees, through the edge and directly over gRPC; then the time to first token and
the gap between tokens through the edge at low concurrency.

Usage::

    python bench/bench_multiplexed.py     # 64 and 256 streams, 10 ms fake steps, --max-running 256
    python bench/bench_multiplexed.py --concurrency 256 --rounds 3 --latency-levels 1,16
    git archive <rev> | tar -x -C /tmp/before && python bench/bench_multiplexed.py --before /tmp/before

One ``--fake-tokens`` worker (``--fake-step-ms``: a sleep per step that releases the GIL, like a
GPU forward; ``--fake-vocab 64``, so the sampler's tensor math, the device's work on a GPU, costs
the host next to nothing) and two edges in front of it, one with ``--no-multiplexed-streams`` (a
``Generate`` call per request) and one with the default (the worker's one ``GenerateStreams``
call). With ``--before``, a worker and an edge run from that checkout too, so that code before a
change is measured in the same run (paths "before: edge" and "before: direct", its own defaults),
and the ratios of CPU per token after to before are printed. Per level
and round, the paths are measured in turn (the order rotating by round), each a window of
``--seconds`` over C streams sent back to back (``bench_edge_overhead.measure``): each edge with
light SSE readers, and direct ``Generate`` and ``GenerateStreams`` calls (``WorkerClient.generate``
and ``open_stream``). Tokens are content bytes over the passage's bytes per token. Printed per
path: tokens/s and the CPU milliseconds per 1,000 tokens of the worker's process tree and of the
edge's, and their sum. Then, per ``--latency-levels`` level, each edge in turn: C users each send
``--latency-requests`` streaming requests one after another (httpx), the median time to first
content and the median gap between content chunks, with the rounds' spread.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from bench_edge_overhead import (  # noqa: E402
    Counts,
    Measurement,
    SseReader,
    StreamOnce,
    content_bytes_per_token,
    direct_request,
    measure,
    parse_list,
    pid_of,
)
from load_edge import chat_body  # noqa: E402

from sluice.client import WorkerCallError, WorkerClient  # noqa: E402
from sluice.compiled import MODULES, built  # noqa: E402
from sluice.streams import EventCall  # noqa: E402
from tests.processes import EdgeProcess, WorkerProcess  # noqa: E402
from worker.config import DEFAULT_CACHE_DIR  # noqa: E402

PATHS = ("edge Generate", "edge GenerateStreams", "direct Generate", "direct GenerateStreams")
BEFORE_PATHS = ("before: edge", "before: direct")
# The fake logits' width: the sampler's tensor math on a full vocabulary (152k columns at 256 rows)
# is the device's work on a GPU, not the host's, so the fake keeps it negligible.
FAKE_VOCAB = 64


class Before:
    """Starts a service from another checkout (``--before``: the code before a change), as a plain
    process whose ``python -m`` finds that checkout's packages first."""

    tree: Path

    def launch(self: Any) -> None:
        with self.log_path.open("wb") as log:
            env = {**self.env, "PYTHONPATH": str(self.tree)}
            self.proc = subprocess.Popen(
                self.args, cwd=self.tree, env=env, stdout=log, stderr=subprocess.STDOUT
            )


class BeforeWorker(Before, WorkerProcess):
    pass


class BeforeEdge(Before, EdgeProcess):
    pass


@contextmanager
def stack(
    args: argparse.Namespace, logs: Path
) -> Iterator[tuple[list[WorkerProcess], dict[str, EdgeProcess]]]:
    """The worker and the two edges (``generate``: per-request calls, ``streams``: multiplexed); with
    ``--before``, that checkout's worker and edge too (edge ``before``)."""
    model = shlex.split(args.worker_args) or [
        *("--fake-tokens", "--fake-step-ms", str(args.step_ms), "--fake-vocab", str(FAKE_VOCAB))
    ]
    extra = [*model, "--max-running", str(args.max_running), "--max-queue", "4096"]
    with ExitStack() as stack_:
        (logs / "worker").mkdir()
        workers = [
            stack_.enter_context(
                WorkerProcess(cache_dir=args.cache_dir, log_dir=logs / "worker", extra=extra)
            )
        ]
        edges = {}
        paths = (("generate", ["--no-multiplexed-streams"]), ("streams", ["--multiplexed-streams"]))
        for name, flags in paths:
            (logs / name).mkdir()
            edges[name] = stack_.enter_context(
                EdgeProcess([workers[0].address], log_dir=logs / name, extra=flags)
            )
        if args.before:
            (logs / "before-worker").mkdir()
            (logs / "before").mkdir()
            BeforeWorker.tree = BeforeEdge.tree = args.before.resolve()
            before = BeforeWorker(cache_dir=args.cache_dir, log_dir=logs / "before-worker", extra=extra)
            workers.append(stack_.enter_context(before))
            edges["before"] = stack_.enter_context(BeforeEdge([before.address], log_dir=logs / "before"))
        yield workers, edges


def direct(client: WorkerClient, multiplexed: bool, max_tokens: int) -> StreamOnce:
    async def once(index: int, counts: Counts) -> None:
        request = direct_request(index, max_tokens)
        call: EventCall = (
            client.open_stream(request, timeout=120) if multiplexed else client.generate(request, timeout=120)
        )
        try:
            while (event := await call.read()) is not None:
                counts.chunks += 1
                if event.HasField("content") and event.content.text:
                    counts.deltas += 1
                    counts.content_bytes += len(event.content.text.encode())
        except WorkerCallError as exc:
            counts.error(exc)
        finally:
            call.cancel()

    return once


def via_edge(edge: EdgeProcess, readers: dict[int, SseReader], users: int, max_tokens: int) -> StreamOnce:
    async def once(index: int, counts: Counts) -> None:
        reader = readers.setdefault(index % users, SseReader(edge.base_url))
        await reader.stream("/v1/chat/completions", chat_body(index, max_tokens, 0.0), counts)

    return once


def cpu_ms(m: Measurement, name: str, bytes_per_token: float) -> float:
    tokens = m.tokens(bytes_per_token)
    return 1e6 * m.cpu[name] / tokens if tokens else float("nan")


async def throughput(
    args: argparse.Namespace, workers: list[WorkerProcess], edges: dict[str, EdgeProcess]
) -> list[str]:
    """Every level's paths, ``args.rounds`` times; the summary table's lines."""
    worker = workers[0]
    pids = {"worker": pid_of(worker), "client": os.getpid()} | {
        f"edge {n}": pid_of(e) for n, e in edges.items()
    }
    clients = {False: WorkerClient(worker.address), True: WorkerClient(worker.address)}
    users = max(args.concurrency)
    readers: dict[str, dict[int, SseReader]] = {name: {} for name in edges}
    once = {
        "edge Generate": via_edge(edges["generate"], readers["generate"], users, args.max_tokens),
        "edge GenerateStreams": via_edge(edges["streams"], readers["streams"], users, args.max_tokens),
        "direct Generate": direct(clients[False], False, args.max_tokens),
        "direct GenerateStreams": direct(clients[True], True, args.max_tokens),
    }
    paths = PATHS
    if "before" in edges:  # the other checkout's worker is measured as "worker" on its own paths
        pids["before worker"] = pid_of(workers[1])
        clients[None] = WorkerClient(workers[1].address)  # type: ignore[index]
        once["before: edge"] = via_edge(edges["before"], readers["before"], users, args.max_tokens)
        once["before: direct"] = direct(clients[None], False, args.max_tokens)  # type: ignore[index]
        paths = PATHS + BEFORE_PATHS
    for path in paths:  # warm every path (connections, first calls)
        await measure(path, once[path], 4, 0.5, pids, workers)
    bytes_per_token = await content_bytes_per_token([clients[False]], args.max_tokens)
    lines = [
        f"worker: {args.worker_args or f'--fake-step-ms {args.step_ms:g} --fake-vocab {FAKE_VOCAB}'} "
        f"--max-running {args.max_running}; max_tokens "
        f"{args.max_tokens}; {args.rounds} rounds of {args.seconds:g} s; medians (min-max)",
        "| streams | path | tok/s | worker CPU ms / 1000 tokens | edge CPU ms / 1000 tokens | sum | errors |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    ratios: list[str] = []
    for level in args.concurrency:

        def described(path: str, m: Measurement) -> str:
            rate, worker_ms = m.tokens_per_s(bytes_per_token), cpu_ms(m, worker_of(path), bytes_per_token)
            return f"{rate:.0f} tok/s, worker {worker_ms:.0f} ms per 1000 tokens, {m.errors} errors"

        runs = await measure_rounds(level, paths, once, args, pids, workers, described)
        for path in paths:
            lines.append(row(level, path, runs[path], bytes_per_token))
        if "before" in edges:
            ratios += [
                f"{level} streams: {now}: {median_cpu(runs[now], bytes_per_token):.0f} against "
                f"{median_cpu(runs[before], bytes_per_token):.0f} ms per 1000 tokens before, "
                f"{median_cpu(runs[now], bytes_per_token) / median_cpu(runs[before], bytes_per_token):.2f}x"
                for now, before in zip(
                    ("edge GenerateStreams", "direct GenerateStreams"), BEFORE_PATHS, strict=True
                )
            ]
    for client in clients.values():
        await client.close()
    for group in readers.values():
        for reader in group.values():
            await reader.close()
    return lines + (["", *ratios] if ratios else [])


async def measure_rounds(
    level: int,
    paths: Sequence[str],
    once: dict[str, StreamOnce],
    args: argparse.Namespace,
    pids: dict[str, int],
    workers: list[WorkerProcess],
    described: Callable[[str, Measurement], str],
) -> dict[str, list[Measurement]]:
    """``args.rounds`` rounds of ``level`` streams on every path, the order rotating by round, each
    a window of ``args.seconds``; prints each measurement as ``described`` says."""
    runs: dict[str, list[Measurement]] = {path: [] for path in paths}
    for round_ in range(args.rounds):
        turn = round_ % len(paths)
        for path in [*paths[turn:], *paths[:turn]]:
            m = await measure(path, once[path], level, args.seconds, pids, workers)
            runs[path].append(m)
            print(f"  {level} streams, round {round_ + 1}, {path}: {described(path, m)}", flush=True)
    return runs


def worker_of(path: str) -> str:
    return "before worker" if path.startswith("before") else "worker"


def edge_of(path: str) -> str | None:
    if path.startswith("before"):
        return "edge before" if path == "before: edge" else None
    return "edge generate" if path == "edge Generate" else "edge streams" if path.startswith("edge") else None


def median_cpu(ms: list[Measurement], bytes_per_token: float) -> float:
    """The median over rounds of the worker's plus the edge's CPU ms per 1000 tokens."""
    path_worker, path_edge = worker_of(ms[0].path), edge_of(ms[0].path)
    edge = (lambda m: cpu_ms(m, path_edge, bytes_per_token)) if path_edge else (lambda m: 0.0)
    return statistics.median(cpu_ms(m, path_worker, bytes_per_token) + edge(m) for m in ms)


def spread(values: list[float], digits: int = 0) -> str:
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def row(level: int, path: str, ms: list[Measurement], bytes_per_token: float) -> str:
    edge = edge_of(path)
    workers = [cpu_ms(m, worker_of(path), bytes_per_token) for m in ms]
    edges = [cpu_ms(m, edge, bytes_per_token) for m in ms] if edge else [0.0 for _ in ms]
    total = [w + e for w, e in zip(workers, edges, strict=True)]
    return (
        f"| {level} | {path} | {spread([m.tokens_per_s(bytes_per_token) for m in ms])} | {spread(workers)} "
        f"| {spread(edges) if edge else '-'} | {spread(total)} | {sum(m.errors for m in ms)} |"
    )


async def latencies(edge: EdgeProcess, users: int, requests: int, max_tokens: int) -> tuple[float, float]:
    """``users`` users each send ``requests`` streaming requests in turn: the median time to first
    content (ms) and the median gap between content chunks (ms)."""
    firsts: list[float] = []
    gaps: list[float] = []

    async def user(client: httpx.AsyncClient, first: int) -> None:
        for index in range(first, first + requests):
            began, last = time.perf_counter(), None
            body = chat_body(index, max_tokens, 0.0)
            async with client.stream("POST", f"{edge.base_url}/v1/chat/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if '"content":"' not in line:
                        continue
                    now = time.perf_counter()
                    if last is None:
                        firsts.append(1000 * (now - began))
                    else:
                        gaps.append(1000 * (now - last))
                    last = now

    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=users)) as client:
        await asyncio.gather(*(user(client, i * requests) for i in range(users)))
    return statistics.median(firsts), statistics.median(gaps)


async def latency_table(args: argparse.Namespace, edges: dict[str, EdgeProcess]) -> list[str]:
    lines = [
        "| streams | edge | time to first token, ms | gap between chunks, ms |",
        "| --- | --- | --- | --- |",
    ]
    for users in args.latency_levels:
        results: dict[str, list[tuple[float, float]]] = {name: [] for name in edges}
        for round_ in range(args.rounds + 1):
            names = list(edges) if round_ % 2 == 0 else list(reversed(edges))
            for name in names:
                result = await latencies(edges[name], users, args.latency_requests, args.latency_tokens)
                if round_:  # the first round warms
                    results[name].append(result)
        for name, values in results.items():
            ttft, gap = [v[0] for v in values], [v[1] for v in values]
            lines.append(f"| {users} | {name} | {spread(ttft, 1)} | {spread(gap, 1)} |")
    return lines


async def run(
    args: argparse.Namespace, workers: list[WorkerProcess], edges: dict[str, EdgeProcess]
) -> list[str]:
    lines = await throughput(args, workers, edges)
    return lines + [""] + await latency_table(args, {n: e for n, e in edges.items() if n != "before"})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", default="64,256", help="comma-separated stream counts")
    parser.add_argument("--step-ms", type=float, default=10.0, help="the fake worker's ms per step")
    parser.add_argument("--max-running", type=int, default=256)
    parser.add_argument(
        "--worker-args",
        default="",
        help="a real worker's flags instead of the fake one's, e.g. \"--model M --device cuda\" (gpu-check)",
    )
    parser.add_argument(
        "--before",
        type=Path,
        help="a checkout of the code before a change (e.g. a `git archive` of it): its worker and edge are "
        "measured in the same run (paths 'before: edge' and 'before: direct', per-request Generate calls)",
    )
    parser.add_argument("--rounds", type=int, default=2, help="rounds per level, each path once a round")
    parser.add_argument("--seconds", type=float, default=4.0, help="length of one measurement window")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--latency-levels", default="1,16", help="stream counts of the latency part")
    parser.add_argument("--latency-requests", type=int, default=4, help="requests per user and round")
    parser.add_argument("--latency-tokens", type=int, default=64)
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR)
    args = parser.parse_args(argv)
    args.concurrency = [int(c) for c in parse_list(int, args.concurrency)]
    args.latency_levels = [int(c) for c in parse_list(int, args.latency_levels)]
    with open("/proc/loadavg") as loadavg:
        print(f"{os.cpu_count()} CPUs, load average {loadavg.read().split()[0]} before starting", flush=True)
    before = f"; --before: {len(built(args.before.resolve()))}" if args.before else ""
    print(f"worker's per-token modules compiled (make compiled): {len(built())} of {len(MODULES)}{before}")
    with (
        tempfile.TemporaryDirectory(prefix="sluice-mux-bench-") as logs,
        stack(args, Path(logs)) as (workers, edges),
    ):
        lines = asyncio.run(run(args, workers, edges))
    print("\n".join(["", *lines]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
