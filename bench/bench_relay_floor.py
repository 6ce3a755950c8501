"""The edge's CPU per SSE chunk against the floor of any Python relay (bench/relay_floor.py).

Usage::

    python bench/bench_relay_floor.py                          # 128 streams, 30 ms/step
    python bench/bench_relay_floor.py --concurrency 64,256 --step-ms 0,30 --rounds 3

Starts the stack of ``bench/bench_edge_overhead.py`` (two fake-token workers,
one edge) and beside it ``bench/relay_floor.py`` on the same workers. For each
pacing, level and round it streams the same requests through the edge and
through the relay with the same light SSE reader (alternating which goes
first) and reads each one's CPU time over the window (``/proc/<pid>/stat``).
Printed per level: each one's CPU ms per 1000 SSE data frames received, its
tokens/s and tokens per content frame, and edge / relay. Paced workers
(``--step-ms`` > 0) give both the same work per second, so the CPU per frame
compares like with like; at full speed each takes what CPU it gets and merges
tokens when it lags, which changes the number of frames.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from bench_edge_overhead import (  # noqa: E402
    Counts,
    Measurement,
    SseReader,
    add_window_args,
    content_bytes_per_token,
    local_stack,
    measure,
    median_of,
    pid_of,
    window_settings,
)
from load_edge import chat_body  # noqa: E402

from sluice.client import WorkerClient  # noqa: E402
from tests.processes import free_port  # noqa: E402


async def wait_listening(port: int, within_s: float = 30.0) -> None:
    end = time.monotonic() + within_s
    while True:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            if time.monotonic() > end:
                raise
            await asyncio.sleep(0.1)
        else:
            writer.close()
            return


def cpu_ms_per_1000(m: Measurement, name: str) -> float:
    return 1e6 * m.cpu[name] / m.chunks if m.chunks else float("nan")


async def run_setting(step_ms: float, args: argparse.Namespace, log_dir: Path) -> list[str]:
    lines = [
        f"\nfake workers at {'full speed' if not step_ms else f'{step_ms:g} ms/step'} (medians):",
        "| streams | edge CPU ms / 1000 SSE frames | relay (floor) CPU ms / 1000 SSE frames | edge / relay "
        "| tok/s, edge / relay | tokens per content frame, edge / relay "
        "| CPU share in edge runs: edge, workers | in relay runs: relay, workers |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    with local_stack(step_ms, 1, args.cache_dir, log_dir) as (edge, workers):
        port = free_port()
        relay = await asyncio.create_subprocess_exec(
            sys.executable,
            str(REPO / "bench" / "relay_floor.py"),
            "--workers",
            ",".join(w.address for w in workers),
            "--port",
            str(port),
            "--max-tokens",
            str(args.max_tokens),
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        try:
            await wait_listening(port)
            pids = {"edge": pid_of(edge), "relay": relay.pid, "client": os.getpid()}
            pids.update({f"worker{i}": pid_of(w) for i, w in enumerate(workers)})
            readers: dict[tuple[str, int], SseReader] = {}
            bases = {"edge": edge.base_url, "relay": f"http://127.0.0.1:{port}"}

            def path_of(name: str) -> Callable[[int, Counts], Awaitable[None]]:
                async def once(index: int, counts: Counts) -> None:
                    reader = readers.setdefault((name, index % args.max_users), SseReader(bases[name]))
                    body = chat_body(index, args.max_tokens, 0.0)
                    await reader.stream("/v1/chat/completions", body, counts)

                return once

            clients = [WorkerClient(w.address) for w in workers]
            bytes_per_token = await content_bytes_per_token(clients, args.max_tokens)
            for client in clients:
                await client.close()
            for name in ("edge", "relay"):  # warm both
                await measure(name, path_of(name), 4, 0.5, pids, workers)
            for concurrency in args.concurrency:
                by_path: dict[str, list[Measurement]] = {"edge": [], "relay": []}
                for round_ in range(args.rounds):
                    order = ["edge", "relay"] if round_ % 2 == 0 else ["relay", "edge"]
                    for name in order:
                        m = await measure(name, path_of(name), concurrency, args.seconds, pids, workers)
                        by_path[name].append(m)
                        print(
                            f"  {concurrency:>3} streams, round {round_ + 1}, {name:>5}: "
                            f"{cpu_ms_per_1000(m, name):.0f} CPU ms / 1000 frames, {m.chunks} frames, "
                            f"{m.errors} errors, CPU share {m.cpu_share(name):.2f}",
                            flush=True,
                        )
                e, r = by_path["edge"], by_path["relay"]
                e_cpu = median_of(e, lambda m: cpu_ms_per_1000(m, "edge"))
                r_cpu = median_of(r, lambda m: cpu_ms_per_1000(m, "relay"))

                def workers_share(m: Measurement) -> float:
                    return sum(m.cpu_share(n) for n in m.cpu if n.startswith("worker"))

                def share(name: str) -> Callable[[Measurement], float]:
                    def of(measurement: Measurement) -> float:
                        return measurement.cpu_share(name)

                    return of

                def tokens_per_frame(m: Measurement) -> float:
                    return m.tokens(bytes_per_token) / max(1, m.deltas)

                lines.append(
                    f"| {concurrency} | {e_cpu:.0f} | {r_cpu:.0f} | {e_cpu / r_cpu:.2f} "
                    f"| {median_of(e, lambda m: m.tokens_per_s(bytes_per_token)):.0f} / "
                    f"{median_of(r, lambda m: m.tokens_per_s(bytes_per_token)):.0f} "
                    f"| {median_of(e, tokens_per_frame):.2f} / {median_of(r, tokens_per_frame):.2f} "
                    f"| {median_of(e, share('edge')):.2f}, {median_of(e, workers_share):.2f} "
                    f"| {median_of(r, share('relay')):.2f}, {median_of(r, workers_share):.2f} |"
                )
                errors = sum(m.errors for m in e + r)
                if errors:
                    lines.append(f"errors at {concurrency} streams: {errors}")
            for reader in readers.values():
                await reader.close()
        finally:
            relay.terminate()
            await asyncio.wait_for(relay.wait(), 10)
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_window_args(parser, concurrency="128", step_ms="30", rounds=2)
    args = parser.parse_args(argv)
    steps = window_settings(parser, args)
    summaries: list[str] = []
    with tempfile.TemporaryDirectory(prefix="sluice-relay-bench-") as logs:
        for i, step_ms in enumerate(steps):
            lines = asyncio.run(run_setting(step_ms, args, Path(logs) / f"setting{i}"))
            print("\n".join(lines), flush=True)
            summaries += lines
    print("\n".join(["\n=== summary ===", *summaries]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
