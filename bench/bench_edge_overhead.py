"""Edge overhead: tokens/s through the edge (SSE) against tokens/s read from the same workers (gRPC).

Usage::

    python bench/bench_edge_overhead.py                        # 1, 16, 64 streams; full speed and 20 ms/step
    python bench/bench_edge_overhead.py --concurrency 64 --rounds 5 --step-ms 20

For each pacing in ``--step-ms`` (0 = full speed) it starts two fake-token
workers (``--fake-tokens``: no model, the normal serving path otherwise) and
one edge in front of them. Then, for each concurrency level C and each of
``--rounds`` rounds, it measures both paths, alternating which goes first:

- **edge**: C tasks send streaming ``POST /v1/chat/completions`` requests back
  to back over loopback (httpx), parsing every SSE chunk as JSON;
- **direct**: C tasks send the same requests as ``Generate`` calls straight
  to the two workers (``sluice.client.WorkerClient``, the client the edge
  itself uses), alternating workers, reading every event.

A measurement is a window of ``--seconds``, opened one second after the C
tasks began streaming requests back to back; the client counts the content
deltas (tokens; the fake passage decodes one delta per token) and the chunks
that arrive inside it. At its end the requests in flight are cancelled (the
client goes away, as a real one may), so no request's tail stretches it.
Printed per level: median tokens/s of each path, their ratio (edge / direct;
the bar is >= 0.90 at 64 streams), the edge process's CPU time per 1000
chunks delivered (utime + stime from ``/proc/<pid>/stat`` at the window's
start and end, over the SSE data frames the client parsed in it), and the
CPU share each process used, which says who was short of CPU.

Everything (client, edge, workers) runs on this machine, so at full speed
the processes compete for the cores: read the paced figures for the edge's
ratio under a realistic token rate and the CPU per 1000 chunks for its cost.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from load_edge import MODEL, PROMPTS, chat_body, local_stack, new_client  # noqa: E402

from sluice.client import WorkerCallError, WorkerClient  # noqa: E402
from sluice.v1 import worker_pb2 as pb  # noqa: E402
from tests.processes import EdgeProcess, WorkerProcess  # noqa: E402
from worker.config import DEFAULT_CACHE_DIR  # noqa: E402

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
REQUEST_TIMEOUT_S = 120.0
WARMUP_S = 1.0  # streams start before a window opens, so it measures the steady state
SETTLE_S = 0.5  # after a window: cancelled requests leave the workers before the next one


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (``/proc/<pid>/stat`` fields 14 and 15)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def pid_of(process: EdgeProcess | WorkerProcess) -> int:
    if process.proc is None:
        raise RuntimeError(f"{process.name} is not running")
    return process.proc.pid


@dataclass
class Counts:
    """What the client received during one measurement window."""

    tokens: int = 0  # content deltas (one per token: the fake passage decodes token by token)
    chunks: int = 0  # SSE data frames (edge) or gRPC events (direct)
    errors: int = 0  # HTTP errors, error events, failed calls


@dataclass
class Measurement:
    path: str
    tokens: int
    chunks: int
    errors: int
    wall: float
    cpu: dict[str, float]  # process name -> CPU seconds used during the window
    worker_steps: float  # engine steps per second, averaged over the workers
    worker_tokens: float  # tokens the workers generated (their counters) per second, all workers

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall

    def cpu_share(self, name: str) -> float:
        """CPU seconds per wall second (1.0 = one core busy)."""
        return self.cpu[name] / self.wall

    @property
    def edge_cpu_ms_per_1000_chunks(self) -> float:
        return 1e6 * self.cpu["edge"] / self.chunks if self.chunks else float("nan")


StreamOnce = Callable[[int, Counts], Awaitable[None]]  # streams request i, counting into Counts


def worker_counters(workers: list[WorkerProcess]) -> tuple[float, float]:
    """(engine steps, generated tokens) so far, summed over the workers' /metrics."""
    scraped = [w.metrics() for w in workers]
    return (
        sum(m["sluice_worker_steps_total"] for m in scraped),
        sum(m["sluice_worker_generated_tokens_total"] for m in scraped),
    )


async def measure(
    path: str,
    once: StreamOnce,
    concurrency: int,
    seconds: float,
    pids: dict[str, int],
    workers: list[WorkerProcess],
) -> Measurement:
    """``concurrency`` tasks stream requests back to back; counts what arrives in a ``seconds`` window
    that opens :data:`WARMUP_S` after they started.

    At the end of the window the counts and CPU times are read, then the
    requests in flight are cancelled (a closed connection or a cancelled call,
    which the edge and the workers handle as a client going away) and the
    stack gets :data:`SETTLE_S` to free them before the next measurement.
    """
    counts = Counts()

    async def user(first: int) -> None:
        index = first
        while True:
            await once(index, counts)
            index += concurrency

    tasks = [asyncio.create_task(user(i)) for i in range(concurrency)]
    await asyncio.sleep(WARMUP_S)  # every stream under way: the window sees the steady state
    before = replace(counts)
    cpu_before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    steps_before, tokens_before = worker_counters(workers)
    started = time.monotonic()
    await asyncio.sleep(seconds)
    wall = time.monotonic() - started
    cpu = {name: cpu_seconds(pid) - cpu_before[name] for name, pid in pids.items()}
    steps_after, tokens_after = worker_counters(workers)
    result = Measurement(
        path,
        counts.tokens - before.tokens,
        counts.chunks - before.chunks,
        counts.errors - before.errors,
        wall,
        cpu,
        (steps_after - steps_before) / wall / len(workers),
        (tokens_after - tokens_before) / wall,
    )
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.sleep(SETTLE_S)
    return result


def direct_request(index: int, max_tokens: int) -> pb.GenerateRequest:
    """The same request as :func:`load_edge.chat_body`, as the edge would send it."""
    return pb.GenerateRequest(
        model=MODEL,
        chat=pb.ChatInput(
            messages=[pb.ChatMessage(role="user", content=PROMPTS[index % len(PROMPTS)])],
            parallel_tool_calls=True,
        ),
        sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0),
    )


async def run_setting(
    step_ms: float, args: argparse.Namespace, log_dir: Path
) -> list[tuple[int, str, list[Measurement]]]:
    print(f"\n== fake workers at {'full speed' if not step_ms else f'{step_ms:g} ms/step'} ==", flush=True)
    rows: list[tuple[int, str, list[Measurement]]] = []
    with local_stack(
        fake_tokens=True, fake_step_ms=step_ms, max_running=128, cache_dir=args.cache_dir, log_dir=log_dir
    ) as (edge, workers):
        pids = {"edge": pid_of(edge), "client": os.getpid()}
        pids.update({f"worker{i}": pid_of(w) for i, w in enumerate(workers)})
        url = f"{edge.base_url}/v1/chat/completions"
        clients = [WorkerClient(w.address) for w in workers]
        async with new_client(max(args.concurrency), REQUEST_TIMEOUT_S) as http:

            async def via_edge(index: int, counts: Counts) -> None:
                body = chat_body(index, args.max_tokens, 0.0)
                try:
                    async with http.stream("POST", url, json=body) as response:
                        if response.status_code != 200:
                            counts.errors += 1
                            await response.aread()
                            return
                        async for line in response.aiter_lines():
                            if line.startswith("data: {"):
                                chunk = json.loads(line[6:])
                                counts.chunks += 1
                                for choice in chunk["choices"]:
                                    if choice["delta"].get("content"):
                                        counts.tokens += 1
                            elif line.startswith("event: error"):
                                counts.errors += 1
                except httpx.HTTPError:
                    counts.errors += 1

            async def direct(index: int, counts: Counts) -> None:
                client = clients[index % len(clients)]
                try:
                    request = direct_request(index, args.max_tokens)
                    async with client.generate(request, timeout=REQUEST_TIMEOUT_S) as call:
                        async for event in call:
                            counts.chunks += 1
                            if event.HasField("content") and event.content.text:
                                counts.tokens += 1
                except WorkerCallError:
                    counts.errors += 1

            # Warm both paths (connections, first-call costs) before measuring.
            await measure("edge", via_edge, 4, 0.5, pids, workers)
            await measure("direct", direct, 4, 0.5, pids, workers)
            for concurrency in args.concurrency:
                by_path: dict[str, list[Measurement]] = {"edge": [], "direct": []}
                for round_ in range(args.rounds):
                    order = [("edge", via_edge), ("direct", direct)]
                    if round_ % 2:
                        order.reverse()
                    for path, once in order:
                        m = await measure(path, once, concurrency, args.seconds, pids, workers)
                        by_path[path].append(m)
                        print(
                            f"  {concurrency:>3} streams, round {round_ + 1}, {path:>6}: "
                            f"{m.tokens_per_s:6.0f} tok/s, {m.errors} errors; workers made "
                            f"{m.worker_tokens:.0f} tok/s in {m.worker_steps:.1f} steps/s each; "
                            f"edge CPU {m.cpu_share('edge'):.2f}",
                            flush=True,
                        )
                rows += [(concurrency, path, ms) for path, ms in by_path.items()]
        for client in clients:
            await client.close()
    return rows


def median_of(ms: list[Measurement], value: Callable[[Measurement], float]) -> float:
    return statistics.median(value(m) for m in ms)


def summary(step_ms: float, rows: list[tuple[int, str, list[Measurement]]]) -> str:
    table = {(c, path): ms for c, path, ms in rows}
    levels = sorted({c for c, _, _ in rows})
    lines = [
        f"\nfake workers at {'full speed' if not step_ms else f'{step_ms:g} ms/step'} (medians):",
        "| streams | edge tok/s | direct tok/s | edge / direct | edge CPU ms / 1000 chunks "
        "| worker steps/s, edge / direct runs "
        "| CPU share in edge runs: edge, workers, client | in direct runs: workers, client |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for c in levels:
        edge, direct = table[(c, "edge")], table[(c, "direct")]
        edge_tps = median_of(edge, lambda m: m.tokens_per_s)
        direct_tps = median_of(direct, lambda m: m.tokens_per_s)

        def workers(m: Measurement) -> float:
            return sum(m.cpu_share(name) for name in m.cpu if name.startswith("worker"))

        lines.append(
            f"| {c} | {edge_tps:.0f} | {direct_tps:.0f} | {edge_tps / direct_tps:.2f} "
            f"| {median_of(edge, lambda m: m.edge_cpu_ms_per_1000_chunks):.0f} "
            f"| {median_of(edge, lambda m: m.worker_steps):.1f} / "
            f"{median_of(direct, lambda m: m.worker_steps):.1f} "
            f"| {median_of(edge, lambda m: m.cpu_share('edge')):.2f}, {median_of(edge, workers):.2f}, "
            f"{median_of(edge, lambda m: m.cpu_share('client')):.2f} "
            f"| {median_of(direct, workers):.2f}, {median_of(direct, lambda m: m.cpu_share('client')):.2f} |"
        )
    errors = sum(m.errors for _, _, ms in rows for m in ms)
    lines.append(f"errors: {errors}")
    return "\n".join(lines)


def parse_list(kind: Callable[[str], float], text: str) -> list:
    return [kind(part) for part in text.split(",") if part.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", default="1,16,64", help="comma-separated stream counts")
    parser.add_argument("--step-ms", default="0,20", help="comma-separated fake pacings (0 = full speed)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per level (each path once per round)")
    parser.add_argument("--seconds", type=float, default=4.0, help="length of one measurement window")
    parser.add_argument("--max-tokens", type=int, default=512, help="max_tokens of each request")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR)
    args = parser.parse_args(argv)
    try:
        args.concurrency = [int(c) for c in parse_list(int, args.concurrency)]
        steps = [float(s) for s in parse_list(float, args.step_ms)]
    except ValueError as exc:
        parser.error(f"--concurrency and --step-ms take comma-separated numbers: {exc}")
    if not args.concurrency or min(args.concurrency) < 1 or not steps or min(steps) < 0:
        parser.error("--concurrency needs counts >= 1 and --step-ms values >= 0")
    if args.rounds < 1 or args.seconds <= 0 or args.max_tokens < 1:
        parser.error("--rounds and --max-tokens must be at least 1, --seconds positive")
    with open("/proc/loadavg") as loadavg:
        load = loadavg.read().split()[0]
    print(
        f"{os.cpu_count()} CPUs, load average {load} before starting; "
        f"{args.rounds} rounds of {args.seconds:g} s per path and level; "
        f"max_tokens {args.max_tokens}",
        flush=True,
    )
    summaries = []
    with tempfile.TemporaryDirectory(prefix="sluice-edge-bench-") as logs:
        for i, step_ms in enumerate(steps):
            folder = Path(logs) / f"setting{i}"
            rows = asyncio.run(run_setting(step_ms, args, folder))
            summaries.append(summary(step_ms, rows))
            print(summaries[-1], flush=True)
    print("\n".join(["\n=== summary ===", *summaries]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
