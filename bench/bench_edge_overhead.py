"""Edge overhead: tokens/s through the edge (SSE) against tokens/s read from the same workers (gRPC).

Usage::

    python bench/bench_edge_overhead.py                     # full speed; 64, 128 and 256 streams
    python bench/bench_edge_overhead.py --concurrency 128 --rounds 5 --step-ms 0,20

For each pacing in ``--step-ms`` (0 = full speed, the default) it starts two
fake-token workers (``--fake-tokens``: no model, the normal serving path
otherwise) and one edge in front of them (``--edge-processes`` processes).
Then, for each concurrency level C and each of ``--rounds`` rounds, it
measures both paths, alternating which goes first:

- **edge**: C tasks send streaming ``POST /v1/chat/completions`` requests back
  to back, each over its own keep-alive connection, read by a light SSE
  reader (:class:`SseReader`: raw asyncio streams, HTTP/1.1 chunked decoding,
  a byte search per frame instead of JSON parsing), so the client costs
  about what the gRPC client costs;
- **direct**: C tasks send the same requests as ``Generate`` calls straight
  to the two workers (``sluice.client.WorkerClient``, the client the edge
  itself uses), alternating workers, reading every event.

A measurement is a window of ``--seconds``, opened one second after the C
tasks began streaming requests back to back. Both paths count the bytes of
content text that arrive inside it; tokens are those bytes divided by the
content bytes per token of the fake passage (measured once, before the
windows, from direct calls that return their token ids), so merged deltas
(the worker merges the steps a lagging caller has not read into one gRPC
message, the edge merges what waits in a stream into one chunk) count for
every token they carry. At its end the requests in flight are cancelled (the client goes
away, as a real one may), so no request's tail stretches it.

Printed per level: median tokens/s of each path, their ratio (edge / direct),
the edge's CPU time (utime + stime of every edge process, from
``/proc/<pid>/stat``) per 1000 tokens delivered and per 1000 SSE chunks the
client received, the tokens per content chunk (SSE) and per content message
(gRPC), and the CPU share each process used, which says who was short of CPU.
``--edge-args`` passes more flags to the edge (e.g. ``'--stream-write-interval
0'`` to compare with the write interval off). Everything runs on this machine, so at full speed the
processes compete for the cores.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from urllib.parse import urlsplit

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from cpu_use import children, cpu_seconds  # noqa: E402
from load_edge import MODEL, PROMPTS, chat_body  # noqa: E402

from sluice.client import WorkerCallError, WorkerClient  # noqa: E402
from sluice.v1 import worker_pb2 as pb  # noqa: E402
from tests.processes import EdgeProcess, WorkerProcess  # noqa: E402
from worker.config import DEFAULT_CACHE_DIR  # noqa: E402

REQUEST_TIMEOUT_S = 120.0
WARMUP_S = 1.0  # streams start before a window opens, so it measures the steady state
SETTLE_S = 0.5  # after a window: cancelled requests leave the workers before the next one


def cpu_of(pid: int, with_children: bool) -> float:
    """CPU seconds of ``pid``, plus those of its children still running when ``with_children``
    (an edge's processes, a worker's engine process; not this client's, which are the servers)."""
    total = cpu_seconds(pid)
    for kid in children(pid) if with_children else []:
        with contextlib.suppress(OSError):  # ended meanwhile
            total += cpu_seconds(kid)
    return total


def pid_of(process: EdgeProcess | WorkerProcess) -> int:
    if process.proc is None:
        raise RuntimeError(f"{process.name} is not running")
    return process.proc.pid


@dataclass
class Counts:
    """What the client received during one measurement window."""

    content_bytes: int = 0  # UTF-8 bytes of content text (JSON escapes counted as one byte)
    deltas: int = 0  # SSE chunks with content (edge) or gRPC content events (direct)
    chunks: int = 0  # SSE data frames (edge) or gRPC events (direct)
    errors: int = 0  # HTTP errors, error events, failed calls
    samples: list[str] = field(default_factory=list)  # what the first few errors said

    def error(self, what: object) -> None:
        self.errors += 1
        if len(self.samples) < 3:
            self.samples.append(repr(what)[:300])


# The content of a chat chunk's delta; the role chunk ({"role":...) does not match.
_CONTENT = re.compile(rb'"delta":\{"content":"((?:[^"\\]|\\.)*)"')


class SseReader:
    """A light HTTP/1.1 client for one keep-alive connection that streams chat completions.

    It sends the request, decodes the chunked body and, per body chunk, counts
    the ``data: {`` frames and the content bytes (one regex scan per chunk, no
    JSON parsing), until the last chunk.
    """

    def __init__(self, base_url: str) -> None:
        parts = urlsplit(base_url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._reader = self._writer = None

    async def stream(self, path: str, body: dict[str, object], counts: Counts) -> None:
        if self._reader is not None and self._reader.at_eof():
            # The server closed this connection while it sat idle (hypercorn's keep-alive timeout,
            # 5 s): open a new one, as HTTP clients do, instead of counting the stale reuse as an error.
            await self.close()
        if self._reader is None or self._writer is None:
            self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
        reader, writer = self._reader, self._writer
        payload = json.dumps(body).encode()
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n"
        )
        writer.write(head.encode() + payload)
        try:
            status = await reader.readuntil(b"\r\n\r\n")
            if not status.startswith(b"HTTP/1.1 200"):
                counts.error(status.split(b"\r\n", 1)[0])
                await self.close()
                return
            while True:
                size = int((await reader.readuntil(b"\r\n"))[:-2], 16)
                if size == 0:
                    await reader.readexactly(2)
                    return
                data = await reader.readexactly(size + 2)
                counts.chunks += data.count(b"data: {")
                for match in _CONTENT.finditer(data):
                    text = match.group(1)
                    counts.content_bytes += len(text) - text.count(b"\\")
                    counts.deltas += 1
                if b"event: error" in data:
                    counts.error(data[data.index(b"event: error") :])
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, ValueError) as exc:
            counts.error(exc)
            await self.close()
        except BaseException:
            await self.close()  # cancelled mid-response: the connection cannot be reused
            raise


@dataclass
class Measurement:
    path: str
    content_bytes: int
    deltas: int
    chunks: int
    errors: int
    wall: float
    cpu: dict[str, float]  # process name -> CPU seconds used during the window
    worker_steps: float  # engine steps per second, averaged over the workers
    worker_tokens: float  # tokens the workers generated (their counters) per second, all workers
    error_samples: tuple[str, ...] = ()  # the first few errors of the measurement, as received

    def tokens_per_s(self, bytes_per_token: float) -> float:
        return self.tokens(bytes_per_token) / self.wall

    def tokens(self, bytes_per_token: float) -> float:
        return self.content_bytes / bytes_per_token

    def cpu_share(self, name: str) -> float:
        """CPU seconds per wall second (1.0 = one core busy)."""
        return self.cpu[name] / self.wall

    def edge_cpu_ms_per_1000_tokens(self, bytes_per_token: float) -> float:
        tokens = self.tokens(bytes_per_token)
        return 1e6 * self.cpu["edge"] / tokens if tokens else float("nan")

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
    cpu_before = {name: cpu_of(pid, name != "client") for name, pid in pids.items()}
    steps_before, tokens_before = worker_counters(workers)
    started = time.monotonic()
    await asyncio.sleep(seconds)
    wall = time.monotonic() - started
    cpu = {name: cpu_of(pid, name != "client") - cpu_before[name] for name, pid in pids.items()}
    steps_after, tokens_after = worker_counters(workers)
    result = Measurement(
        path,
        counts.content_bytes - before.content_bytes,
        counts.deltas - before.deltas,
        counts.chunks - before.chunks,
        counts.errors - before.errors,
        wall,
        cpu,
        (steps_after - steps_before) / wall / len(workers),
        (tokens_after - tokens_before) / wall,
        tuple(counts.samples),
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


async def content_bytes_per_token(clients: list[WorkerClient], max_tokens: int) -> float:
    """Bytes of content text per generated token, from a few whole direct calls that ask for the
    token ids (outside any window: a worker may put several tokens in one message, and the edge
    several in one chunk, so neither path's message count is a token count)."""
    text_bytes = tokens = 0
    for index, client in enumerate(clients * 2):
        request = direct_request(index, max_tokens)
        request.return_token_ids = True
        async with client.generate(request, timeout=REQUEST_TIMEOUT_S) as call:
            async for event in call:
                if event.HasField("content"):
                    text_bytes += len(event.content.text.encode())
                    tokens += len(event.content.token_ids)
    return text_bytes / max(1, tokens)


@contextlib.contextmanager
def local_stack(
    step_ms: float, edge_processes: int, cache_dir: Path, log_dir: Path, edge_args: Sequence[str] = ()
) -> Iterator[tuple[EdgeProcess, list[WorkerProcess]]]:
    """Two fake-token workers and one edge (``edge_processes`` processes, plus ``edge_args``) in
    front of them."""
    extra = ["--max-running", "128", "--max-queue", "1024", "--fake-tokens", "--fake-step-ms", str(step_ms)]
    edge_extra = ["--processes", str(edge_processes)] if edge_processes != 1 else []
    edge_extra += edge_args
    with contextlib.ExitStack() as stack:
        workers = []
        for i in range(2):
            folder = log_dir / f"worker{i}"
            folder.mkdir(parents=True, exist_ok=True)
            workers.append(
                stack.enter_context(WorkerProcess(cache_dir=cache_dir, log_dir=folder, extra=extra))
            )
        edge_dir = log_dir / "edge"
        edge_dir.mkdir(parents=True, exist_ok=True)
        edge = EdgeProcess([w.address for w in workers], log_dir=edge_dir, extra=edge_extra)
        yield stack.enter_context(edge), workers


async def run_setting(
    step_ms: float, args: argparse.Namespace, log_dir: Path
) -> tuple[list[tuple[int, str, list[Measurement]]], float]:
    """Every level's measurements of both paths, and the content bytes per token."""
    print(f"\n== fake workers at {'full speed' if not step_ms else f'{step_ms:g} ms/step'} ==", flush=True)
    rows: list[tuple[int, str, list[Measurement]]] = []
    stack = local_stack(step_ms, args.edge_processes, args.cache_dir, log_dir, shlex.split(args.edge_args))
    with stack as (edge, workers):
        pids = {"edge": pid_of(edge), "client": os.getpid()}
        pids.update({f"worker{i}": pid_of(w) for i, w in enumerate(workers)})
        clients = [WorkerClient(w.address) for w in workers]
        readers: dict[int, SseReader] = {}

        async def via_edge(index: int, counts: Counts) -> None:
            # One connection per user (index modulo the level), reused request after request.
            reader = readers.setdefault(index % args.max_users, SseReader(edge.base_url))
            await reader.stream("/v1/chat/completions", chat_body(index, args.max_tokens, 0.0), counts)

        async def direct(index: int, counts: Counts) -> None:
            client = clients[index % len(clients)]
            try:
                request = direct_request(index, args.max_tokens)
                async with client.generate(request, timeout=REQUEST_TIMEOUT_S) as call:
                    async for event in call:
                        counts.chunks += 1
                        if event.HasField("content") and event.content.text:
                            counts.deltas += 1
                            counts.content_bytes += len(event.content.text.encode())
            except WorkerCallError as exc:
                counts.error(exc)

        # Warm both paths (connections, first-call costs) before measuring.
        await measure("edge", via_edge, 4, 0.5, pids, workers)
        await measure("direct", direct, 4, 0.5, pids, workers)
        bytes_per_token = await content_bytes_per_token(clients, args.max_tokens)
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
                        f"{m.content_bytes / m.wall:8.0f} content B/s in {m.chunks} chunks, "
                        f"{m.errors} errors; workers made "
                        f"{m.worker_tokens:.0f} tok/s in {m.worker_steps:.1f} steps/s each; "
                        f"edge CPU {m.cpu_share('edge'):.2f}",
                        flush=True,
                    )
                    for sample in m.error_samples if m.errors else ():
                        print(f"      error: {sample}", flush=True)
            rows += [(concurrency, path, ms) for path, ms in by_path.items()]
        for client in clients:
            await client.close()
        for reader in readers.values():
            await reader.close()
    return rows, bytes_per_token


def median_of(ms: list[Measurement], value: Callable[[Measurement], float]) -> float:
    return statistics.median(value(m) for m in ms)


def summary(step_ms: float, rows: list[tuple[int, str, list[Measurement]]], bytes_per_token: float) -> str:
    table = {(c, path): ms for c, path, ms in rows}
    levels = sorted({c for c, _, _ in rows})
    lines = [
        f"\nfake workers at {'full speed' if not step_ms else f'{step_ms:g} ms/step'} (medians; "
        f"{bytes_per_token:.2f} content bytes per token):",
        "| streams | edge tok/s | direct tok/s | edge / direct | edge CPU ms / 1000 tokens "
        "| edge CPU ms / 1000 SSE chunks | tokens per content chunk: SSE (edge) / gRPC (direct) "
        "| worker steps/s, edge / direct runs "
        "| CPU share in edge runs: edge, workers, client | in direct runs: workers, client |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for c in levels:
        edge, direct = table[(c, "edge")], table[(c, "direct")]
        edge_tps = median_of(edge, lambda m: m.tokens_per_s(bytes_per_token))
        direct_tps = median_of(direct, lambda m: m.tokens_per_s(bytes_per_token))

        def workers(m: Measurement) -> float:
            return sum(m.cpu_share(name) for name in m.cpu if name.startswith("worker"))

        lines.append(
            f"| {c} | {edge_tps:.0f} | {direct_tps:.0f} | {edge_tps / direct_tps:.2f} "
            f"| {median_of(edge, lambda m: m.edge_cpu_ms_per_1000_tokens(bytes_per_token)):.0f} "
            f"| {median_of(edge, lambda m: m.edge_cpu_ms_per_1000_chunks):.0f} "
            f"| {median_of(edge, lambda m: m.tokens(bytes_per_token) / max(1, m.deltas)):.2f} / "
            f"{median_of(direct, lambda m: m.tokens(bytes_per_token) / max(1, m.deltas)):.2f} "
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


def add_window_args(parser: argparse.ArgumentParser, *, concurrency: str, step_ms: str, rounds: int) -> None:
    """The options of the stack and its measurement windows ."""
    parser.add_argument("--concurrency", default=concurrency, help="comma-separated stream counts")
    parser.add_argument("--step-ms", default=step_ms, help="comma-separated fake pacings (0 = full speed)")
    parser.add_argument("--rounds", type=int, default=rounds, help="rounds per level, each path once a round")
    parser.add_argument("--seconds", type=float, default=4.0, help="length of one measurement window")
    parser.add_argument("--max-tokens", type=int, default=256, help="max_tokens of each request")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR)


def window_settings(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[float]:
    """Checks :func:`add_window_args`'s options (``parser.error`` on a bad one), turns
    ``args.concurrency`` into counts, sets ``args.max_users``; returns the pacings."""
    try:
        args.concurrency = [int(c) for c in parse_list(int, args.concurrency)]
        steps = [float(s) for s in parse_list(float, args.step_ms)]
    except ValueError as exc:
        parser.error(f"--concurrency and --step-ms take comma-separated numbers: {exc}")
    if not args.concurrency or min(args.concurrency) < 1 or not steps or min(steps) < 0:
        parser.error("--concurrency needs counts >= 1 and --step-ms values >= 0")
    if args.rounds < 1 or args.seconds <= 0 or args.max_tokens < 1:
        parser.error("--rounds and --max-tokens must be at least 1, --seconds positive")
    args.max_users = max(args.concurrency)
    return steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_window_args(parser, concurrency="64,128,256", step_ms="0", rounds=3)
    parser.add_argument("--edge-processes", type=int, default=1, help="the edge's --processes")
    parser.add_argument(
        "--edge-args", default="", help="more edge flags, e.g. '--stream-write-interval 0' (shell words)"
    )
    args = parser.parse_args(argv)
    steps = window_settings(parser, args)
    if args.edge_processes < 1:
        parser.error("--edge-processes must be at least 1")
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
            rows, bytes_per_token = asyncio.run(run_setting(step_ms, args, folder))
            summaries.append(summary(step_ms, rows, bytes_per_token))
            print(summaries[-1], flush=True)
    print("\n".join(["\n=== summary ===", *summaries]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
