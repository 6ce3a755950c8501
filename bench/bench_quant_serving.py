"""Serving the default model float32 against quantized: one worker per ``--quantization``, same load.

Usage::

    python bench/bench_quant_serving.py                          # none,int4; 1 and 16 streams; 3 rounds
    python bench/bench_quant_serving.py --schemes none,int8,int4 --rounds 5

Starts one worker per scheme (``python -m worker --quantization S --max-running 32``;
idle workers use no CPU), prints each worker's resident memory after loading
(VmRSS) and its peak while loading (VmHWM), then runs the throughput bar's load
against them alternately, level by level, for ``--rounds`` rounds: C streaming
chat requests at once over gRPC, ``--max-tokens`` (64) tokens each, one of four
story prompts, temperature 1 with ``ignore_eos`` so every stream is 64 tokens.
The summary takes each level's median run and gives every scheme's ratio to
``none`` and to the llama-server figures issue 13 quotes for this machine.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_worker import (
    PROMPTS,
    LevelResult,
    StreamResult,
    median_level,
    read_stream,
    report,
    start_worker,
    stop,
)

from sluice.v1 import worker_pb2 as pb
from sluice.v1 import worker_pb2_grpc as pb_grpc

# llama-server serving SmolLM2-135M-Instruct.Q4_1.gguf on this machine (issue 13): tok/s, TTFT p95.
LLAMA_SERVER = {1: (99.6, None), 16: (110.0, 3.0)}


def memory_mb(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) of a process in MB."""
    fields = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line
    )
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


async def stream(stub: pb_grpc.WorkerStub, i: int, max_tokens: int) -> StreamResult:
    request = pb.GenerateRequest(
        chat=pb.ChatInput(messages=[pb.ChatMessage(role="user", content=PROMPTS[i % len(PROMPTS)])]),
        sampling=pb.SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True),
    )
    return await read_stream(stub, request)


async def level(stub: pb_grpc.WorkerStub, c: int, max_tokens: int) -> LevelResult:
    start = time.perf_counter()
    results = await asyncio.gather(*[stream(stub, i, max_tokens) for i in range(c)])
    return LevelResult(c, time.perf_counter() - start, list(results))


async def measure(
    addresses: dict[str, str], levels: list[int], rounds: int, max_tokens: int
) -> dict[str, dict[int, LevelResult]]:
    runs: dict[str, dict[int, list[LevelResult]]] = {s: {} for s in addresses}
    channels = {s: grpc.aio.insecure_channel(a) for s, a in addresses.items()}
    try:
        stubs = {s: pb_grpc.WorkerStub(ch) for s, ch in channels.items()}
        for stub in stubs.values():
            await stream(stub, 0, 8)  # warm-up
        for round_ in range(rounds):
            for c in levels:
                for scheme, stub in stubs.items():
                    result = await level(stub, c, max_tokens)
                    runs[scheme].setdefault(c, []).append(result)
                    report(f"{scheme[:4]} r{round_ + 1}", result)
    finally:
        for ch in channels.values():
            await ch.close()
    return {s: {c: median_level(r) for c, r in by_level.items()} for s, by_level in runs.items()}


def summary(medians: dict[str, dict[int, LevelResult]]) -> None:
    print("\nsummary (median run of each level)")
    for scheme, by_level in medians.items():
        for result in by_level.values():
            report(scheme[:6], result)
    base = medians.get("none", {})
    for scheme, by_level in medians.items():
        for c, result in by_level.items():
            parts = [
                f"{scheme:5} c={c:<3} {result.tokens_per_s:6.1f} tok/s, ttft p95 {result.ttft(0.95):.2f} s"
            ]
            if c in base and scheme != "none":
                parts.append(f"{result.tokens_per_s / base[c].tokens_per_s:.2f}x float32")
            if c in LLAMA_SERVER:
                tok_s, ttft = LLAMA_SERVER[c]
                parts.append(f"{result.tokens_per_s / tok_s:.2f}x llama-server's {tok_s}")
                if ttft is not None:
                    parts.append(f"ttft p95 vs llama-server's {ttft} s")
            print("  " + ", ".join(parts))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--schemes", default="none,int4")
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--cache-dir", help="the workers' converted-model cache")
    parser.add_argument("--worker-args", default="", help="more flags for every worker")
    args = parser.parse_args()
    schemes = args.schemes.split(",")
    levels = [int(c) for c in args.concurrency.split(",")]
    procs = []
    try:
        addresses = {}
        for scheme in schemes:  # one at a time: each load's peak memory is its own
            proc, address = start_worker(
                args.cache_dir, ["--quantization", scheme, *args.worker_args.split()]
            )
            procs.append(proc)
            addresses[scheme] = address
            rss, peak = memory_mb(proc.pid)
            print(
                f"{scheme:5} worker after loading: resident {rss:6.0f} MB, peak while loading {peak:6.0f} MB",
                flush=True,
            )
        medians = asyncio.run(measure(addresses, levels, args.rounds, args.max_tokens))
    finally:
        for proc in procs:
            stop(proc)
    summary(medians)


if __name__ == "__main__":
    main()
