"""Does one big request stall the other streams? Inter-token gaps of 16 streams, with and without it.

Usage::

    python bench/bench_big_request.py                 # starts a worker with the default model
    python bench/bench_big_request.py --rounds 5 --worker 127.0.0.1:50051

Each round runs 16 streams (bench_worker.py's load) twice, alternating: alone, and
with one big request arriving after the first tokens: a JSON schema of
``--schema-properties`` properties (compiled for constrained decoding) and a
conversation of ``--turns`` turns (rendered with the chat template and tokenized),
asking for one token. Keep the conversation short: a long prompt's prefill stalls the
other streams on purpose (bounded by --max-prefill-tokens), which is not what this measures.
The worker prepares requests (template, tokenization,
grammar) in its prepare threads, so the big request should not widen the 16
streams' inter-token gap p95. Printed: each round's gap p50/p95 both ways and the
median ratio of p95 (with / without).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_worker import quantile, sluice_stream, start_worker, stop

from sluice.v1 import worker_pb2 as pb
from sluice.v1 import worker_pb2_grpc as pb_grpc

STREAMS = 16


def big_request(properties: int, turns: int) -> pb.GenerateRequest:
    schema = {
        "type": "object",
        "properties": {
            f"field_{i}": {
                "type": "object",
                "properties": {"value": {"type": "string"}, "n": {"type": "integer"}},
            }
            for i in range(properties)
        },
        "required": [f"field_{i}" for i in range(properties)],
    }
    messages = [
        pb.ChatMessage(
            role="user" if i % 2 == 0 else "assistant", content=f"Turn {i}: " + "lorem ipsum " * 40
        )
        for i in range(turns)
    ] + [pb.ChatMessage(role="user", content="Fill the form.")]
    request = pb.GenerateRequest(
        chat=pb.ChatInput(messages=messages), sampling=pb.SamplingParams(temperature=0, max_tokens=1)
    )
    request.response_format.json_schema.CopyFrom(pb.JsonSchema(name="form", schema_json=json.dumps(schema)))
    return request


async def gaps(stub: pb_grpc.WorkerStub, big: pb.GenerateRequest | None) -> tuple[list[float], float]:
    """The 16 streams' inter-token gaps; with ``big``, sent 0.5 s in. Returns (gaps, big's latency)."""
    streams = [asyncio.create_task(sluice_stream(stub, i)) for i in range(STREAMS)]
    latency = float("nan")
    if big is not None:
        await asyncio.sleep(0.5)
        loop = asyncio.get_running_loop()
        start = loop.time()
        try:
            async for _ in stub.Generate(big):
                pass
        except grpc.aio.AioRpcError as error:  # a too-long prompt is a fine probe too
            print(f"  big request ended with {error.code().name}: {error.details()}")
        latency = loop.time() - start
    results = await asyncio.gather(*streams)
    return [g for r in results for g in r.gaps], latency


async def run(address: str, rounds: int, big: pb.GenerateRequest) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.WorkerStub(channel)
        await gaps(stub, None)  # warm-up
        ratios = []
        for round_ in range(rounds):
            alone, _ = await gaps(stub, None)
            mixed, latency = await gaps(stub, big)
            p95_alone, p95_mixed = quantile(alone, 0.95), quantile(mixed, 0.95)
            ratios.append(p95_mixed / p95_alone)
            print(
                f"round {round_ + 1}: gap p50/p95 alone "
                f"{quantile(alone, 0.5) * 1e3:.1f}/{p95_alone * 1e3:.1f} ms, "
                f"with the big request {quantile(mixed, 0.5) * 1e3:.1f}/{p95_mixed * 1e3:.1f} ms "
                f"(its own latency {latency:.2f} s)"
            )
        print(f"median p95 ratio (with / without): {statistics.median(ratios):.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--worker", help="an already running worker (host:port); default: start one")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--schema-properties", type=int, default=400)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--cache-dir", default=None)
    args = parser.parse_args()
    big = big_request(args.schema_properties, args.turns)
    proc = None
    address = args.worker
    if address is None:
        proc, address = start_worker(args.cache_dir, ["--max-prefill-tokens", "4096"])
    try:
        asyncio.run(run(address, args.rounds, big))
    finally:
        if proc is not None:
            stop(proc)


if __name__ == "__main__":
    main()
