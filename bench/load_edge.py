"""Edge load test: many concurrent streaming chat requests through one edge and two workers.

Usage::

    python bench/load_edge.py                          # 200 streams, real default-model workers
    python bench/load_edge.py --fake-tokens            # workers that run no model (model/fake_runner.py)
    python bench/load_edge.py --fake-tokens --fake-step-ms 20 --requests 1000 --duration 30
    python bench/load_edge.py --edge http://127.0.0.1:8080   # an edge that is already running

It starts two workers and one edge on 127.0.0.1 (free ports; logs in a
temporary folder, printed on failure), then ``--concurrency`` client tasks
(default 200) send streaming ``POST /v1/chat/completions`` requests over
loopback with httpx and read the SSE streams to the end, parsing every
chunk. The run is bounded: ``--requests`` in all (default: one per stream),
no new request after ``--duration`` seconds, and each request is abandoned
after ``--timeout`` seconds (counted as a ``timeout`` error).

Printed: completion tokens/s (all completion tokens, from each stream's
usage chunk, over the wall time), errors by kind, time to first content
token p50/p95/max, and the wall time. Error kinds: ``http_<status>`` (an
error answer before the stream), ``stream_error`` (an ``event: error`` in
the stream), ``no_done`` (the stream ended without ``data: [DONE]``),
``bad_chunk`` (a data line that is not JSON), ``timeout``, ``connect`` and
``transport`` (httpx errors).

The stream client and the process start-up here are shared with
``bench/bench_edge_overhead.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench_worker import PROMPTS  # noqa: E402  (the same prompts as the engine benchmark)

from tests.processes import EdgeProcess, WorkerProcess  # noqa: E402
from worker.config import DEFAULT_CACHE_DIR  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"


@dataclass
class StreamResult:
    """One streamed request as the client saw it."""

    error: str | None = None  # an error kind (see the module docstring), None when it ended well
    ttft: float | None = None  # seconds to the first content delta
    completion_tokens: int = 0  # from the usage chunk
    chunks: int = 0  # data frames parsed (role, content, finish and usage chunks)
    seconds: float = 0.0


def chat_body(index: int, max_tokens: int, temperature: float) -> dict[str, object]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": PROMPTS[index % len(PROMPTS)]}],
        "max_tokens": max_tokens,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def stream_chat(
    client: httpx.AsyncClient, url: str, body: dict[str, object], request_timeout_s: float
) -> StreamResult:
    """Sends one streaming chat request and reads it to the end; never raises (errors are kinds)."""
    result = StreamResult()
    started = time.monotonic()
    try:
        async with asyncio.timeout(request_timeout_s):
            await _read_stream(client, url, body, result, started)
    except (TimeoutError, httpx.TimeoutException):
        result.error = "timeout"
    except httpx.ConnectError:
        result.error = "connect"
    except httpx.HTTPError:
        result.error = "transport"
    result.seconds = time.monotonic() - started
    return result


async def _read_stream(
    client: httpx.AsyncClient, url: str, body: dict[str, object], result: StreamResult, started: float
) -> None:
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            await response.aread()
            result.error = f"http_{response.status_code}"
            return
        done = False
        async for line in response.aiter_lines():
            if line.startswith("event: error"):
                result.error = "stream_error"
            if not line.startswith("data: "):
                continue  # blank separators and ": heartbeat" comments
            payload = line[6:]
            if payload == "[DONE]":
                done = True
                continue
            try:
                chunk = json.loads(payload)
            except ValueError:
                result.error = result.error or "bad_chunk"
                continue
            result.chunks += 1
            choices = chunk.get("choices") or ()
            if result.ttft is None and any(c.get("delta", {}).get("content") for c in choices):
                result.ttft = time.monotonic() - started
            usage = chunk.get("usage")
            if usage:
                result.completion_tokens = usage["completion_tokens"]
        if not done and result.error is None:
            result.error = "no_done"


def new_client(concurrency: int, timeout: float) -> httpx.AsyncClient:
    """An httpx client with a connection per concurrent stream (keep-alive reused between requests)."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout, connect=10.0))


async def run_load(
    base_url: str,
    *,
    concurrency: int,
    requests: int,
    duration: float | None,
    request_timeout_s: float,
    max_tokens: int,
    temperature: float,
    client: httpx.AsyncClient | None = None,
) -> tuple[list[StreamResult], float]:
    """``concurrency`` tasks send requests back to back until ``requests`` were sent or ``duration``
    passed; returns every result and the wall time."""
    url = f"{base_url}/v1/chat/completions"
    results: list[StreamResult] = []
    sent = 0
    started = time.monotonic()

    async def user(own: httpx.AsyncClient) -> None:
        nonlocal sent
        while sent < requests and (duration is None or time.monotonic() - started < duration):
            index = sent
            sent += 1
            body = chat_body(index, max_tokens, temperature)
            results.append(await stream_chat(own, url, body, request_timeout_s))

    async with contextlib.AsyncExitStack() as stack:
        if client is None:
            client = await stack.enter_async_context(new_client(concurrency, request_timeout_s))
        await asyncio.gather(*(user(client) for _ in range(min(concurrency, requests))))
    return results, time.monotonic() - started


def quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def report(results: list[StreamResult], wall: float) -> str:
    tokens = sum(r.completion_tokens for r in results)
    errors = Counter(r.error for r in results if r.error)
    ttfts = [r.ttft for r in results if r.ttft is not None]
    lines = [
        f"requests: {len(results)} ({len(results) - sum(errors.values())} ok)",
        f"completion tokens: {tokens} in {wall:.2f} s = {tokens / wall:.1f} tokens/s",
        "errors: " + (", ".join(f"{kind} {count}" for kind, count in sorted(errors.items())) or "none"),
        f"TTFT p50 {quantile(ttfts, 0.5):.3f} s, p95 {quantile(ttfts, 0.95):.3f} s, "
        f"max {max(ttfts, default=float('nan')):.3f} s",
        f"wall time: {wall:.2f} s",
    ]
    return "\n".join(lines)


@contextlib.contextmanager
def local_stack(
    *,
    workers: int = 2,
    fake_tokens: bool = False,
    fake_step_ms: float = 0.0,
    max_running: int = 32,
    torch_threads: int | None = None,
    cache_dir: Path,
    log_dir: Path,
) -> Iterator[tuple[EdgeProcess, list[WorkerProcess]]]:
    """``workers`` worker processes and one edge in front of them, stopped on exit."""
    extra = ["--max-running", str(max_running), "--max-queue", "1024"]
    if fake_tokens:
        extra += ["--fake-tokens", "--fake-step-ms", str(fake_step_ms)]
    if torch_threads is not None:
        extra += ["--torch-threads", str(torch_threads)]
    with contextlib.ExitStack() as stack:
        started: list[WorkerProcess] = []
        for i in range(workers):
            folder = log_dir / f"worker{i}"
            folder.mkdir(parents=True, exist_ok=True)
            started.append(
                stack.enter_context(WorkerProcess(cache_dir=cache_dir, log_dir=folder, extra=extra))
            )
        edge_dir = log_dir / "edge"
        edge_dir.mkdir(parents=True, exist_ok=True)
        edge = stack.enter_context(EdgeProcess([w.address for w in started], log_dir=edge_dir))
        yield edge, started


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--edge", help="base URL of a running edge (default: start two workers and an edge here)")
    add("--concurrency", type=int, default=200, help="concurrent streams")
    add("--requests", type=int, default=None, help="requests in all (default: --concurrency)")
    add("--duration", type=float, default=None, help="seconds after which no new request starts")
    add("--timeout", type=float, default=120.0, help="seconds one request may take")
    add("--max-tokens", type=int, default=32, help="max_tokens of each request")
    add("--temperature", type=float, default=0.0)
    add("--fake-tokens", action="store_true", help="workers that run no model (worker/model/fake_runner.py)")
    add("--fake-step-ms", type=float, default=0.0, help="with --fake-tokens: ms per fake forward")
    add("--max-running", type=int, default=None, help="workers' --max-running (default 32; 128 fake)")
    add(
        "--torch-threads",
        type=int,
        default=max(1, (os.cpu_count() or 2) // 2),
        help="each worker's --torch-threads (default: half the cores, as two workers share them)",
    )
    add("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR, help="workers' model cache")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("concurrency", "max_tokens", "requests"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if args.timeout <= 0 or (args.duration is not None and args.duration <= 0):
        parser.error("--timeout and --duration must be positive")
    if args.fake_step_ms and not args.fake_tokens:
        parser.error("--fake-step-ms only applies with --fake-tokens")
    requests = args.requests or args.concurrency

    def load(base_url: str) -> tuple[list[StreamResult], float]:
        return asyncio.run(
            run_load(
                base_url,
                concurrency=args.concurrency,
                requests=requests,
                duration=args.duration,
                request_timeout_s=args.timeout,
                max_tokens=args.max_tokens,
                temperature=args.temperature,
            )
        )

    if args.edge:
        print(report(*load(args.edge.rstrip("/"))))
        return 0
    max_running = args.max_running or (128 if args.fake_tokens else 32)
    mode = f"fake tokens, {args.fake_step_ms:g} ms/step" if args.fake_tokens else "default model"
    with tempfile.TemporaryDirectory(prefix="sluice-load-") as logs:
        print(
            f"starting 2 workers ({mode}, --max-running {max_running}, --torch-threads "
            f"{'default' if args.fake_tokens else args.torch_threads}) and an edge ...",
            flush=True,
        )
        with local_stack(
            fake_tokens=args.fake_tokens,
            fake_step_ms=args.fake_step_ms,
            max_running=max_running,
            torch_threads=None if args.fake_tokens else args.torch_threads,
            cache_dir=args.cache_dir,
            log_dir=Path(logs),
        ) as (edge, _workers):
            print(
                f"{args.concurrency} concurrent streams, {requests} requests, max_tokens {args.max_tokens}",
                flush=True,
            )
            results, wall = load(edge.base_url)
    print(report(results, wall))
    return 0


if __name__ == "__main__":
    sys.exit(main())
