"""A worker short of KV blocks behind an edge: concurrent n > 1 completions that must be preempted
and recomputed, then one small request; prints the engine's progress and how long the small one took.

    python bench/bench_crowded_pool.py                      # the default model, 40 blocks of 16
    python bench/bench_crowded_pool.py --model PATH --worker-args "--max-batch-tokens 640"
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shlex
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.processes import EdgeProcess, WorkerProcess
from worker.config import DEFAULT_CACHE_DIR

WORDS = ["river", "mill", "bread", "town", "water", "clerk", "morning", "coffee", "north", "baker"]
POOL = "--quantization none --kv-cache-bytes 29500000 --max-prefill-tokens 64"


async def complete(client: httpx.AsyncClient, model: str, prompt: str, n: int, max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "n": n, "max_tokens": max_tokens, "ignore_eos": True}
    response = await client.post("/v1/completions", json={**body, "temperature": 0.8})
    response.raise_for_status()
    return response.json()


async def watch(worker: WorkerProcess, started: float) -> None:
    names = ("queue_depth", "running_requests", "preemptions_total", "steps_total")
    while True:
        metrics = await asyncio.to_thread(worker.metrics)
        shown = {name: int(metrics.get(f"sluice_worker_{name}", 0)) for name in names}
        print(f"{time.monotonic() - started:6.1f} s  {shown}", flush=True)
        await asyncio.sleep(5)


async def run(args: argparse.Namespace, worker: WorkerProcess, edge: EdgeProcess) -> None:
    rng = random.Random(args.seed)
    prompts = [
        (" ".join(rng.choices(WORDS, k=rng.randint(70, 110))), 2 + i % 2) for i in range(args.requests)
    ]
    started = time.monotonic()
    watcher = asyncio.create_task(watch(worker, started))
    async with httpx.AsyncClient(base_url=edge.base_url, timeout=args.timeout) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        answers = await asyncio.gather(*[complete(client, model, p, n, args.max_tokens) for p, n in prompts])
        crowd = time.monotonic() - started
        asked = time.monotonic()
        await complete(client, model, "Hello", 1, 2)
        small = time.monotonic() - asked
    watcher.cancel()
    finished = sum(len(a["choices"]) for a in answers)
    print(f"{len(answers)} requests, {finished} choices finished in {crowd:.1f} s")
    print(f"a 2-token request afterwards: {small:.3f} s")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="model folder (default: the default model)")
    parser.add_argument("--worker-args", default=POOL, help=f"the worker's pool flags (default: {POOL})")
    parser.add_argument("--requests", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=60)
    parser.add_argument("--seed", type=int, default=30)
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="crowded-"))
    extra = shlex.split(args.worker_args)
    with (
        WorkerProcess(cache_dir=DEFAULT_CACHE_DIR, log_dir=logs, model=args.model, extra=extra) as worker,
        EdgeProcess([worker.address], log_dir=logs) as edge,
    ):
        asyncio.run(run(args, worker, edge))


if __name__ == "__main__":
    main()
