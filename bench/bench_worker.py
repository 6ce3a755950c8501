"""Engine benchmark: concurrent streams against a Sluice worker (gRPC) and, optionally, the peer.

Usage::

    python bench/bench_worker.py                      # starts a worker with the default model
    python bench/bench_worker.py --peer               # ... and compares with the peer
    python bench/bench_worker.py --worker 127.0.0.1:50051 --concurrency 1,16
    python bench/bench_worker.py --peer --worker-args="--stream-interval 4"   # a worker setting
    python bench/bench_worker.py --lora 1,4,8 --concurrency 8   # LoRA adapters against the base
    python bench/bench_worker.py --tensor-parallel 1,3 --concurrency 1,8   # step time by rank count

For each concurrency level C, C streams start at once; request i asks for
64 + (37 * i mod 65) tokens (64 to 128) at temperature 1 for one of a few
story prompts, so both servers get the same load. Printed per level:
aggregate completion tokens/s (all tokens / wall time), time to first token
p50/p95, inter-token gap p50/p95/p99.9 (p99.9: the stalls every stream sees at once, such as
a garbage collection), and for a worker it started (or ``--worker-pid``) the CPU its processes
and this client used (bench/cpu_use.py); then the 16-to-1 throughput ratio and, with
--peer, Sluice / peer ratios. Both servers stay up (each idles at no CPU)
while the load alternates between them, level by level, for --rounds rounds;
the summary takes each level's median run, so a noisy moment on this shared
machine does not decide a ratio.
With --tensor-parallel 1,3 it starts one worker per size in turn, the default
model in float32 sharded over that many ranks (``-tp``), and prints each
level's decode step time (the inter-token gap p50) per size.
The peer needs `pip install "transformers[serving]"` and loads the same
converted checkpoint the worker uses.

With ``--lora 1,4,8`` the started worker serves 8 random rank-8 PEFT adapters over every
attention and MLP projection (``--enable-lora --max-loras 8``, built with peft in a temporary
folder) and each level also runs with its streams spread over 1, 4 and 8 adapters (stream i
names adapter i mod N); the summary prints each one's tokens/s against the base model's on the
same worker. ``--max-tokens N`` caps every stream's tokens, for a short run on a slow machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from cpu_use import cpu_line, snapshot  # noqa: E402

from sluice.cli import worker_command  # noqa: E402
from sluice.v1 import worker_pb2 as pb  # noqa: E402
from sluice.v1 import worker_pb2_grpc as pb_grpc  # noqa: E402

PROMPTS = [
    "Write a long story about a dragon who learns to cook.",
    "Explain in detail how a steam engine works.",
    "Describe a journey across the ocean on a small sailing boat.",
    "Write a long letter to a friend about your favourite books.",
]


@dataclass
class StreamResult:
    tokens: int = 0
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)


@dataclass
class LevelResult:
    concurrency: int
    wall: float
    results: list[StreamResult]

    @property
    def tokens_per_s(self) -> float:
        return sum(r.tokens for r in self.results) / self.wall

    def ttft(self, q: float) -> float:
        return quantile([r.ttft for r in self.results if r.ttft is not None], q)

    def gap(self, q: float) -> float:
        return quantile([g for r in self.results for g in r.gaps], q)


def quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


MAX_TOKENS = [128]  # --max-tokens: a cap on every stream's tokens (a short run)


def load(i: int) -> tuple[str, int]:
    return PROMPTS[i % len(PROMPTS)], min(64 + (37 * i) % 65, MAX_TOKENS[0])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# ------------------------------------------------------------------ Sluice


STORY_SCHEMA = json.dumps(
    {
        "type": "object",
        "properties": {"title": {"type": "string"}, "story": {"type": "string"}},
        "required": ["title", "story"],
        "additionalProperties": False,
    }
)


async def sluice_stream(
    stub: pb_grpc.WorkerStub, i: int, constrained: bool = False, adapters: int = 0
) -> StreamResult:
    """Stream ``i`` of a level; with ``adapters`` N, under LoRA adapter ``i mod N``."""
    prompt, max_tokens = load(i)
    request = pb.GenerateRequest(
        model=f"{LORA_PREFIX}{i % adapters}" if adapters else "",
        chat=pb.ChatInput(messages=[pb.ChatMessage(role="user", content=prompt)]),
        sampling=pb.SamplingParams(temperature=1.0, max_tokens=max_tokens),
    )
    if constrained:  # the same load under a JSON-schema grammar
        request.response_format.json_schema.CopyFrom(pb.JsonSchema(name="story", schema_json=STORY_SCHEMA))
    return await read_stream(stub, request)


async def read_stream(stub: pb_grpc.WorkerStub, request: pb.GenerateRequest) -> StreamResult:
    """One Generate call's time to first token, inter-token gaps and completion tokens."""
    result, start, last = StreamResult(), time.perf_counter(), None
    async for event in stub.Generate(request):
        kind = event.WhichOneof("event")
        if kind == "content":
            now = time.perf_counter()
            if result.ttft is None:
                result.ttft = now - start
            elif last is not None:
                result.gaps.append(now - last)
            last = now
        elif kind == "usage":
            result.tokens = event.usage.completion_tokens
    return result


async def sluice_level(
    stub: pb_grpc.WorkerStub, c: int, constrained: bool = False, adapters: int = 0
) -> LevelResult:
    start = time.perf_counter()
    results = await asyncio.gather(*[sluice_stream(stub, i, constrained, adapters) for i in range(c)])
    return LevelResult(c, time.perf_counter() - start, list(results))


LORA_PREFIX = "lora"  # --lora's adapters are lora0, lora1, ...
LORA_RANK = 8


def lora_flags(model_dir: str, count: int, folder: Path) -> list[str]:
    """Worker flags serving ``count`` random PEFT adapters of ``model_dir``, written in ``folder``."""
    from tests.lora_adapters import build_adapter

    modules = [
        f"{LORA_PREFIX}{i}={build_adapter(Path(model_dir), folder / str(i), seed=i, rank=LORA_RANK)}"
        for i in range(count)
    ]
    flags = ["--enable-lora", "--max-loras", str(count), "--max-lora-rank", str(LORA_RANK)]
    return [*flags, "--lora-modules", " ".join(modules)]


# The benchmark's worker flags unless the caller's own say otherwise.
WORKER_DEFAULTS = ("--max-running", "32", "--log-level", "WARNING")


def merged_flags(defaults: Sequence[str], extra: Sequence[str]) -> list[str]:
    """``defaults`` (``--flag value`` pairs) without the flags ``extra`` sets, then ``extra``: the
    caller's flags win, and each flag appears once."""
    given = {item.split("=", 1)[0] for item in extra if item.startswith("--")}
    kept: list[str] = []
    for flag, value in zip(defaults[::2], defaults[1::2], strict=True):
        if flag not in given:
            kept += [flag, value]
    return kept + list(extra)


def start_worker(
    cache_dir: str | None,
    extra: list[str],
    defaults: Sequence[str] = WORKER_DEFAULTS,
    metrics_port: int = 0,
) -> tuple[subprocess.Popen[bytes], str]:
    """A worker on a free port (``metrics_port`` 0: no /metrics); returns it and its address once
    its health check says SERVING."""
    port = free_port()
    args = worker_command(port, metrics_port, *merged_flags(defaults, extra))
    if cache_dir:
        args += ["--cache-dir", cache_dir]
    proc = subprocess.Popen(args, cwd=REPO)
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the worker exited with status {proc.returncode}")
        try:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return proc, f"127.0.0.1:{port}"
        except grpc.RpcError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("the worker did not start")


# -------------------------------------------------------------------- peer


async def peer_stream(client: httpx.AsyncClient, url: str, model: str, i: int) -> StreamResult:
    prompt, max_tokens = load(i)
    body = {
        "model": model,
        "stream": True,
        "max_tokens": max_tokens,
        "temperature": 1.0,
        "messages": [{"role": "user", "content": prompt}],
        "stream_options": {"include_usage": True},
    }
    return await read_sse_stream(client, url, body)


async def sse_chunks(response: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """The JSON chunks of an OpenAI-style Server-Sent Events stream (``[DONE]`` and other lines
    left out)."""
    async for line in response.aiter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


async def read_sse_stream(client: httpx.AsyncClient, url: str, body: dict[str, object]) -> StreamResult:
    """One streamed OpenAI chat completion's time to first token, gaps and completion tokens
    (the usage chunk's count, else the number of content chunks)."""
    result, start, last, chunks, usage = StreamResult(), time.perf_counter(), None, 0, None
    async with client.stream("POST", url, json=body) as response:
        response.raise_for_status()
        async for chunk in sse_chunks(response):
            if chunk.get("usage"):
                usage = chunk["usage"].get("completion_tokens")
            if any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or []):
                now = time.perf_counter()
                chunks += 1
                if result.ttft is None:
                    result.ttft = now - start
                elif last is not None:
                    result.gaps.append(now - last)
                last = now
    result.tokens = usage or chunks
    return result


async def peer_level(client: httpx.AsyncClient, url: str, model: str, c: int) -> LevelResult:
    start = time.perf_counter()
    results = await asyncio.gather(*[peer_stream(client, url, model, i) for i in range(c)])
    return LevelResult(c, time.perf_counter() - start, list(results))


def start_peer(
    model_dir: str, device: str = "cpu", dtype: str = "auto"
) -> tuple[subprocess.Popen[bytes], str]:
    """Starts ``transformers serve --continuous-batching`` pinned to ``model_dir``; returns it and its
    base URL once /health answers."""
    port = free_port()
    # The CLI's module rather than its console script: a --target install has no script.
    cli = [sys.executable, "-c", "from transformers.cli.transformers import main; main()"]
    proc = subprocess.Popen(
        [
            *cli,
            "serve",
            "--continuous-batching",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--device",
            device,
            "--dtype",
            dtype,
            model_dir,
        ],
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise SystemExit("the peer exited; is transformers[serving] installed?")
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("the peer did not start")


def default_model_dir(cache_dir: str | None) -> str:
    from worker.config import DEFAULT_CACHE_DIR
    from worker.model.loader import converted_gguf_folder, default_gguf_path

    return str(
        converted_gguf_folder(default_gguf_path(), Path(cache_dir) if cache_dir else DEFAULT_CACHE_DIR)
    )


# ------------------------------------------------------------------ report


def report(name: str, r: LevelResult) -> None:
    tokens = sum(x.tokens for x in r.results)
    print(
        f"{name:>6} c={r.concurrency:<3} {r.tokens_per_s:7.1f} tok/s  ({tokens} tokens in {r.wall:5.1f} s)  "
        f"ttft p50 {r.ttft(0.5):5.2f} s p95 {r.ttft(0.95):5.2f} s  "
        f"gap p50 {r.gap(0.5) * 1000:6.1f} ms p95 {r.gap(0.95) * 1000:6.1f} ms "
        f"p99.9 {r.gap(0.999) * 1000:6.1f} ms",
        flush=True,
    )


def median_level(runs: list[LevelResult]) -> LevelResult:
    """The run with the median throughput (its latencies are reported with it)."""
    return sorted(runs, key=lambda r: r.tokens_per_s)[len(runs) // 2]


def lora_summary(sluice: dict[int, LevelResult], lora: dict[str, dict[int, LevelResult]]) -> None:
    """Each level's tokens/s under N adapters against the base model's on the same worker."""
    for name, results in lora.items():
        for c, run in results.items():
            if c in sluice:
                ratio = run.tokens_per_s / sluice[c].tokens_per_s
                print(
                    f"  c={c:<3} {name}: {run.tokens_per_s:.1f} vs base {sluice[c].tokens_per_s:.1f} tok/s "
                    f"({ratio:.2f}x)"
                )


def summary(
    sluice: dict[int, LevelResult],
    peer: dict[int, LevelResult],
    constrained: dict[int, LevelResult],
    lora: dict[str, dict[int, LevelResult]] | None = None,
) -> None:
    print("\nsummary (median run of each level)")
    for name, results in (("sluice", sluice), ("json", constrained), ("peer", peer), *(lora or {}).items()):
        for level in results.values():
            report(name, level)
    lora_summary(sluice, lora or {})
    for c, plain in sluice.items():
        if c in constrained:
            json_run = constrained[c]
            extra = (json_run.gap(0.5) - plain.gap(0.5)) * 1000
            print(
                f"  c={c:<3} constrained decoding: {json_run.tokens_per_s:.1f} vs "
                f"{plain.tokens_per_s:.1f} tok/s "
                f"({json_run.tokens_per_s / plain.tokens_per_s:.2f}x), inter-token gap p50 {extra:+.1f} ms"
            )
    for name, results in (("sluice", sluice), ("peer", peer)):
        if 1 in results and 16 in results:
            ratio = results[16].tokens_per_s / results[1].tokens_per_s
            print(f"  {name} 16-to-1 throughput ratio: {ratio:.2f}x")
    for c, ours in sluice.items():
        if c in peer:
            print(
                f"  c={c:<3} sluice/peer throughput {ours.tokens_per_s / peer[c].tokens_per_s:.2f}x, "
                f"ttft p95 sluice {ours.ttft(0.95):.2f} s vs peer {peer[c].ttft(0.95):.2f} s"
            )


async def measure(
    address: str,
    peer_base: str | None,
    peer_model: str,
    levels: list[int],
    rounds: int,
    constrained: bool,
    worker_pid: int | None = None,
    lora: Sequence[int] = (),
) -> dict[str, dict[int, LevelResult]]:
    """Runs every level ``rounds`` times: Sluice, Sluice under a JSON grammar (with --constrained),
    Sluice spread over each of ``lora``'s adapter counts ("lora N") and the peer (with --peer)
    alternating, one at a time. Returns the median runs of each, by name. With the worker's pid,
    each Sluice run is followed by the CPU its processes and this client used."""
    runs: dict[str, dict[int, list[LevelResult]]] = {"sluice": {}, "json": {}, "peer": {}}
    runs.update({f"lora {n}": {} for n in lora})
    url = f"{peer_base}/v1/chat/completions"
    async with grpc.aio.insecure_channel(address) as channel, httpx.AsyncClient(timeout=600) as client:
        stub = pb_grpc.WorkerStub(channel)
        await sluice_stream(stub, 0)  # warm-up
        if constrained:
            await sluice_stream(stub, 0, constrained=True)
        if peer_base:
            await peer_stream(client, url, peer_model, 0)
        for round_ in range(rounds):
            for c in levels:
                plan = [("sluice", lambda c=c: sluice_level(stub, c))]
                if constrained:
                    plan.append(("json", lambda c=c: sluice_level(stub, c, constrained=True)))
                for n in lora:
                    plan.append((f"lora {n}", lambda c=c, n=n: sluice_level(stub, c, adapters=n)))
                if peer_base:
                    plan.append(("peer", lambda c=c: peer_level(client, url, peer_model, c)))
                for name, run in plan:
                    before = snapshot(worker_pid) if worker_pid and name != "peer" else None
                    result = await run()
                    runs[name].setdefault(c, []).append(result)
                    report(f"{name} r{round_ + 1}", result)
                    if before is not None:
                        tokens = sum(r.tokens for r in result.results)
                        print(f"       {cpu_line(before, snapshot(before.root), tokens)}", flush=True)
    return {name: {c: median_level(r) for c, r in by_level.items()} for name, by_level in runs.items()}


TENSOR_PARALLEL_FLAGS = ("--quantization", "none", "--dtype", "float32")


def tensor_parallel(
    sizes: list[int], cache_dir: str | None, extra: list[str], levels: list[int], rounds: int
) -> None:
    """``--tensor-parallel``: per size, a worker of the default model in float32 over that many ranks,
    the levels' median runs, and the step time (inter-token gap p50) by size and level."""
    steps: dict[int, dict[int, float]] = {}
    for size in sizes:
        proc, address = start_worker(cache_dir, [*TENSOR_PARALLEL_FLAGS, "-tp", str(size), *extra])
        try:
            medians = asyncio.run(measure(address, None, "", levels, rounds, False, proc.pid))["sluice"]
        finally:
            stop(proc)
        steps[size] = {c: medians[c].gap(0.5) * 1000 for c in levels}
    print("\ndecode step time (inter-token gap p50), default model in float32:")
    for size, by_level in steps.items():
        line = ", ".join(f"{by_level[c]:.1f} ms at {c} streams" for c in levels)
        print(f"  --tensor-parallel-size {size}: {line}")


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--worker", help="address of a running worker (default: start one)")
    parser.add_argument(
        "--worker-pid", type=int, help="that worker's pid: print the CPU its processes use (Linux)"
    )
    parser.add_argument(
        "--peer", action="store_true", help="also run transformers serve --continuous-batching"
    )
    parser.add_argument("--concurrency", default="1,4,16,32")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each level; the median is reported")
    parser.add_argument("--cache-dir", help="the worker's converted-model cache")
    parser.add_argument(
        "--worker-args", default="", help='more flags for the started worker, e.g. "--stream-interval 4"'
    )
    parser.add_argument(
        "--constrained", action="store_true", help="also run the load under a JSON-schema grammar"
    )
    parser.add_argument(
        "--lora",
        default="",
        help="adapter counts, e.g. 1,4,8: the started worker serves that many random LoRA adapters "
        "and each level also runs spread over each count (tokens/s against the base model)",
    )
    parser.add_argument("--max-tokens", type=int, default=128, help="cap each stream's tokens (a short run)")
    parser.add_argument(
        "--tensor-parallel",
        help="sizes to compare, e.g. 1,3: the default model in float32 with --tensor-parallel-size each",
    )
    args = parser.parse_args()
    MAX_TOKENS[0] = args.max_tokens
    levels = [int(c) for c in args.concurrency.split(",")]
    lora = [int(n) for n in args.lora.split(",") if n]
    if lora and args.worker:
        parser.error("--lora starts its own worker (with the adapters); leave out --worker")
    if args.tensor_parallel:
        sizes = [int(size) for size in args.tensor_parallel.split(",")]
        tensor_parallel(sizes, args.cache_dir, shlex.split(args.worker_args), levels, args.rounds)
        return

    procs = []
    adapters = tempfile.TemporaryDirectory(prefix="bench-lora-")
    try:
        address, worker_pid = args.worker, args.worker_pid
        if address is None:
            extra = shlex.split(args.worker_args)
            if lora:
                model = default_model_dir(args.cache_dir) if "--model" not in extra else ""
                model = model or extra[extra.index("--model") + 1]
                extra += lora_flags(model, max(lora), Path(adapters.name))
            proc, address = start_worker(args.cache_dir, extra)
            procs.append(proc)
            worker_pid = proc.pid
        peer_base, peer_model = None, ""
        if args.peer:
            peer_model = default_model_dir(args.cache_dir)
            peer_proc, peer_base = start_peer(peer_model)
            procs.append(peer_proc)
        medians = asyncio.run(
            measure(address, peer_base, peer_model, levels, args.rounds, args.constrained, worker_pid, lora)
        )
    finally:
        for proc in procs:
            stop(proc)
        adapters.cleanup()
    lora_runs = {name: runs for name, runs in medians.items() if name.startswith("lora")}
    summary(medians["sluice"], medians["peer"], medians["json"], lora_runs)


if __name__ == "__main__":
    main()
