"""What ``--speculative ngram`` gives through the edge: one worker started with it and an edge in
front; each case runs with the request's ``speculative: false`` (plain decoding) and without it
(speculating), alternating within each round (which goes first swaps each round), streamed over
HTTP as a client sees it.

Cases: one greedy stream copying a given paragraph (input-grounded), one greedy open-chat stream,
one sampled (seeded) copying stream, and ``--streams`` concurrent greedy streams of both prompts.
One stream: decode tok/s from the first to the last content chunk; several: completion tokens /
wall time. Prints one table (medians over the rounds), the ratio, the acceptance from the worker's
/metrics, and whether the texts matched.

    python bench/bench_speculative_edge.py
    python bench/bench_speculative_edge.py --rounds 2 --tokens 128 --worker-args "--torch-threads 2"
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_speculative import PROMPTS, print_table
from bench.bench_worker import sse_chunks
from tests.processes import EdgeProcess, WorkerProcess
from worker.config import DEFAULT_CACHE_DIR

PROPOSED = "sluice_worker_speculative_proposed_tokens_total"
ACCEPTED = "sluice_worker_speculative_accepted_tokens_total"


async def stream(client: httpx.AsyncClient, body: dict[str, Any]) -> tuple[str, int, float, float]:
    """Text, completion tokens, first and last content chunk times of one streamed chat request."""
    text: list[str] = []
    first = last = 0.0
    tokens = 0
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for chunk in sse_chunks(response):
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", []):
                if choice["delta"].get("content"):
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    text.append(choice["delta"]["content"])
    return "".join(text), tokens, first, last


async def run(args: argparse.Namespace, worker: WorkerProcess, edge: EdgeProcess) -> None:
    async with httpx.AsyncClient(base_url=edge.base_url, timeout=600) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]

        def body(prompt: str, **sampling: Any) -> dict[str, Any]:
            message = {"role": "user", "content": prompt}
            return {"model": model, "messages": [message], "max_tokens": args.tokens, **sampling}

        copy, chat = PROMPTS["input-grounded (copy)"], PROMPTS["open chat"]
        greedy = {"temperature": 0}
        cases: dict[str, list[dict[str, Any]]] = {
            "1 stream, input-grounded (copy), greedy": [body(copy, **greedy)],
            "1 stream, open chat, greedy": [body(chat, **greedy)],
            "1 stream, input-grounded (copy), sampled (0.7, seeded)": [body(copy, temperature=0.7, seed=5)],
            f"{args.streams} streams, both prompts, greedy": [
                body(p, **greedy) for p in [copy, chat] * (args.streams // 2)
            ],
        }
        rates: dict[tuple[str, str], list[float]] = {}
        tallies = {name: [0.0, 0.0] for name in cases}
        same = dict.fromkeys(cases, True)
        await stream(client, body(chat, max_tokens=8))  # warm-up
        for round_index in range(args.rounds):
            for name, bodies in cases.items():
                texts = {}
                # Each round swaps which goes first, so an even number of rounds cancels order effects.
                for kind in ("plain", "ngram") if round_index % 2 == 0 else ("ngram", "plain"):
                    sent = [b if kind == "ngram" else {**b, "speculative": False} for b in bodies]
                    before = await asyncio.to_thread(worker.metrics)
                    started = time.perf_counter()
                    results = await asyncio.gather(*(stream(client, b) for b in sent))
                    if len(results) == 1:
                        _, count, first, last = results[0]
                        rate = (count - 1) / (last - first)
                    else:
                        rate = sum(r[1] for r in results) / (time.perf_counter() - started)
                    after = await asyncio.to_thread(worker.metrics)
                    rates.setdefault((name, kind), []).append(rate)
                    texts[kind] = [r[0] for r in results]
                    if kind == "ngram":
                        tallies[name][0] += after.get(ACCEPTED, 0) - before.get(ACCEPTED, 0)
                        tallies[name][1] += after.get(PROPOSED, 0) - before.get(PROPOSED, 0)
                same[name] = same[name] and texts["plain"] == texts["ngram"]
    print(
        f"through the edge: {model}, worker {args.worker_args!r}, max_tokens {args.tokens}, "
        f"medians of {args.rounds} rounds"
    )
    print_table(cases, rates, tallies, same, "speculating tok/s")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="model folder (default: the default model)")
    parser.add_argument(
        "--worker-args", default="", help="more worker flags (--speculative ngram unless they set it)"
    )
    parser.add_argument("--tokens", type=int, default=128, help="max_tokens of each request")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="speculative-edge-"))
    extra = ["--speculative", "ngram", *shlex.split(args.worker_args)]
    with (
        WorkerProcess(cache_dir=DEFAULT_CACHE_DIR, log_dir=logs, model=args.model, extra=extra) as worker,
        EdgeProcess([worker.address], log_dir=logs) as edge,
    ):
        asyncio.run(run(args, worker, edge))


if __name__ == "__main__":
    main()
