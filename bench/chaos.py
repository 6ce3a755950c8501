"""Chaos run: two workers behind one edge, one of them abused, clients misbehaving, for a bounded time.

Everything runs on 127.0.0.1: two workers (``--fake-tokens`` by default, so the
run costs little CPU; ``--real-model`` serves the default model) and one edge
with its default settings. For ``--duration`` seconds:

- **worker chaos** on the first worker (the second one is the survivor): at
  random intervals, SIGKILL then a restart on the same port after a pause,
  SIGSTOP for a few seconds then SIGCONT, or a graceful restart (SIGTERM);
- **clients** (``--clients`` concurrent loops) send a random mix: complete
  streams, non-streaming requests, streams they disconnect from early, slow
  readers, and bad bodies (malformed JSON, wrong types, out-of-range numbers).

At the end, after the first worker is back and the edge settled, it checks and
prints:

1. every client got a complete stream (a ``finish_reason`` per choice, then
   ``data: [DONE]``), or an ``event: error`` whose error is followed by
   ``data: [DONE]``, or a clean 4xx/503 JSON error before any stream (never
   another 5xx, a cut stream or a hang); every bad body got a 4xx;
2. the edge answers (``/health``, and a request is served) and the surviving
   worker answers its gRPC health check;
3. nothing is left running in any worker (``/metrics`` gauges: running
   requests, queue depth, live KV caches all 0);
4. the edge's resident memory is within 10 % of where it was after warm-up.

The exit status is 0 when every check passed. ``make chaos`` runs it for three
minutes; figures are in docs/testing.md.

    python bench/chaos.py --duration 180
    python bench/chaos.py --duration 40 --seed 7 --real-model
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import random
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.processes import EdgeProcess, WorkerProcess  # noqa: E402
from worker.config import DEFAULT_CACHE_DIR  # noqa: E402

MODEL = "chaos"
# A response that sends no byte for this long counts as a hang (the edge's heartbeats come
# every 15 s, and a SIGSTOP lasts at most 6 s); so does a request not over after TOTAL_S, a
# bound far above the slowest reader's own pace (about 200 lines at up to 0.4 s each).
HANG_S = 60.0
TOTAL_S = 300.0
# Worker gauges that must be back at 0 once every client is gone.
IDLE_GAUGES = ("sluice_worker_running_requests", "sluice_worker_queue_depth", "sluice_worker_live_caches")
RSS_TOLERANCE = 0.10

# Bodies the edge must refuse with a 4xx (raw bytes: some are not JSON at all).
MALFORMED_BODIES: list[bytes] = [
    b"{",
    b"not json",
    b"[]",
    b'{"model": "chaos"}',
    b'{"model": "chaos", "messages": "hello"}',
    b'{"model": "chaos", "messages": [{"role": "wizard", "content": "hi"}]}',
    b'{"model": "chaos", "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}',
    b'{"model": "chaos", "messages": [{"role": "user", "content": "hi"}], "n": 0}',
    b'{"model": "chaos", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -5}',
    b'{"model": "chaos", "messages": [{"role": "user", "content": "hi"}], "stream": "yes"}',
    b'{"model": "chaos", "messages": [{"role": "user", "content": "hi"}], "top_p": 7}',
    b'{"model": "other", "messages": [{"role": "user", "content": "hi"}]}',
    b'{"model": "chaos", "messages": [{"role": "user", "content": "\\ud800"}], "stop": 5}',
]
OUT_OF_RANGE_BODIES: list[bytes] = [
    b'{"model": "chaos", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1000000000000}',
    b'{"model": "chaos", "messages": [{"role": "user", "content": "hi"}], "seed": 99999999999999999999}',
    b'{"model": "chaos", "prompt": "hi", "max_tokens": 1e300}',
    b'{"model": "chaos", "messages": [{"role": "user", "content": "hi"}], "logit_bias": {"99999999999": 1}}',
]


@dataclass
class Outcome:
    """One client request: its kind and what happened (``ok`` false = a failed check)."""

    kind: str
    result: str
    ok: bool
    detail: str = ""


@dataclass
class Tally:
    outcomes: list[Outcome] = field(default_factory=list)
    actions: collections.Counter[str] = field(default_factory=collections.Counter)

    def add(self, outcome: Outcome) -> None:
        self.outcomes.append(outcome)


def chat_body(rng: random.Random, *, stream: bool) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"Tell me about the number {rng.randint(0, 10**6)}."}],
        "max_tokens": rng.randint(4, 96),
        "stream": stream,
        "n": rng.choice([1, 1, 1, 2]),
    }


def pre_stream_error(response: httpx.Response, body: bytes) -> tuple[str, bool, str]:
    """A response that is not a stream: a clean 4xx/503 with the OpenAI error body, or a failure."""
    code = response.status_code
    try:
        error = json.loads(body)["error"]
        clean = isinstance(error, dict) and isinstance(error.get("message"), str)
    except (ValueError, KeyError, TypeError):
        clean = False
    if not clean:
        return f"{code} without an error body", False, body[:200].decode(errors="replace")
    if code == 503 or 400 <= code < 500:
        return f"{code}", True, ""
    return f"{code}", False, body[:200].decode(errors="replace")


def check_stream(lines: list[str], choices: int) -> tuple[str, bool, str]:
    """The SSE rules: complete (a finish per choice, then [DONE]) or an error event then [DONE]."""
    data = [line[len("data: ") :] for line in lines if line.startswith("data: ")]
    if not data or data[-1] != "[DONE]":
        return "cut stream (no [DONE])", False, "\n".join(lines[-5:])
    if data.count("[DONE]") != 1:
        return "several [DONE]", False, ""
    if "event: error" in lines:
        after = lines[lines.index("event: error") + 1 :]
        payload = next((line for line in after if line.startswith("data: ")), "")
        try:
            error = json.loads(payload[len("data: ") :])["error"]
        except (ValueError, KeyError):
            return "error event without an error", False, payload
        if data[-2] != payload[len("data: ") :]:
            return "error event not followed by [DONE]", False, ""
        return f"error event ({error.get('code') or error.get('type')})", True, ""
    finished = set()
    for chunk in data[:-1]:
        for choice in json.loads(chunk).get("choices", []):
            if choice.get("finish_reason"):
                finished.add(choice["index"])
    if finished != set(range(choices)):
        return "stream without every finish_reason", False, ""
    return "complete stream", True, ""


async def stream_request(client: httpx.AsyncClient, rng: random.Random, kind: str, tally: Tally) -> None:
    body = chat_body(rng, stream=True)
    lines: list[str] = []
    stop_after = rng.randint(1, 6) if kind == "disconnect" else None
    delay = rng.uniform(0.05, 0.4) if kind == "slow reader" else 0.0
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            result, ok, detail = pre_stream_error(response, await response.aread())
            tally.add(Outcome(kind, result, ok, detail))
            return
        async for line in response.aiter_lines():
            if line:
                lines.append(line)
            if stop_after is not None and len(lines) >= stop_after:
                tally.add(Outcome(kind, "disconnected by the client", True))
                return  # leaving the block closes the connection mid-stream
            if delay:
                await asyncio.sleep(delay)
    result, ok, detail = check_stream(lines, body["n"])
    tally.add(Outcome(kind, result, ok, detail))


async def plain_request(client: httpx.AsyncClient, rng: random.Random, tally: Tally) -> None:
    response = await client.post("/v1/chat/completions", json=chat_body(rng, stream=False))
    if response.status_code == 200:
        choices = response.json().get("choices", [])
        ok = bool(choices) and all(c.get("finish_reason") for c in choices)
        tally.add(Outcome("non-streaming", "200", ok, "" if ok else response.text[:200]))
    else:
        result, ok, detail = pre_stream_error(response, response.content)
        tally.add(Outcome("non-streaming", result, ok, detail))


async def bad_request(client: httpx.AsyncClient, rng: random.Random, kind: str, tally: Tally) -> None:
    body = rng.choice(MALFORMED_BODIES if kind == "malformed body" else OUT_OF_RANGE_BODIES)
    path = "/v1/completions" if b'"prompt"' in body else "/v1/chat/completions"
    response = await client.post(path, content=body, headers={"content-type": "application/json"})
    result, clean, detail = pre_stream_error(response, response.content)
    ok = clean and 400 <= response.status_code < 500
    tally.add(Outcome(kind, result, ok, "" if ok else f"{body.decode(errors='replace')} -> {detail}"))


KINDS = {
    "stream": 4,
    "non-streaming": 2,
    "disconnect": 2,
    "slow reader": 1,
    "malformed body": 1,
    "out-of-range body": 1,
}


async def client_loop(base_url: str, rng: random.Random, until: float, tally: Tally) -> None:
    timeout = httpx.Timeout(HANG_S, connect=10.0)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout) as client:
        while time.monotonic() < until:
            kind = rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
            try:
                async with asyncio.timeout(TOTAL_S):
                    if kind in ("stream", "disconnect", "slow reader"):
                        await stream_request(client, rng, kind, tally)
                    elif kind == "non-streaming":
                        await plain_request(client, rng, tally)
                    else:
                        await bad_request(client, rng, kind, tally)
            except TimeoutError:
                tally.add(Outcome(kind, f"hang (not over in {TOTAL_S:.0f} s)", False))
            except httpx.ReadTimeout:
                tally.add(Outcome(kind, f"hang (no byte for {HANG_S:.0f} s)", False))
            except httpx.HTTPError as error:
                tally.add(Outcome(kind, f"transport error ({type(error).__name__})", False, str(error)))


def worker_chaos(victim: WorkerProcess, rng: random.Random, until: float, tally: Tally) -> None:
    """Runs in a thread: abuses ``victim`` until ``until`` (the caller brings it back after).

    A restart waits for the worker to be ready only half of the time: the other half, the
    next blow may land while it is still starting (a worker starts in seconds alone, but in
    a minute on a loaded 2-core machine, which would leave few blows per run).
    """
    actions: list[str] = []
    while time.monotonic() < until:
        time.sleep(rng.uniform(1.0, 4.0))
        if time.monotonic() >= until:
            break
        if not actions:  # every kind once per round, in a random order
            actions = rng.sample(["SIGKILL + restart", "SIGSTOP + SIGCONT", "graceful restart"], 3)
        action = actions.pop()
        tally.actions[action] += 1
        if action == "SIGSTOP + SIGCONT":
            victim.signal(signal.SIGSTOP)
            time.sleep(rng.uniform(1.0, 6.0))
            victim.signal(signal.SIGCONT)
            continue
        if action == "SIGKILL + restart":
            victim.kill()
            time.sleep(rng.uniform(0.5, 4.0))
        else:
            victim.signal(signal.SIGCONT)  # a stopped process cannot drain
            victim.stop()
        victim.launch()
        if rng.random() < 0.5:
            with contextlib.suppress(RuntimeError):  # it may exit: its port is still held
                victim.wait_ready()


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for {pid}")


def grpc_serving(address: str) -> bool:
    try:
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    except grpc.RpcError:
        return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def wait_idle(workers: list[WorkerProcess], within_s: float) -> dict[str, dict[str, float]]:
    """The idle gauges of each worker, once all are 0 (or as they are after ``within_s``)."""
    deadline = time.monotonic() + within_s
    while True:
        gauges = {w.address: {g: w.metrics().get(g, -1.0) for g in IDLE_GAUGES} for w in workers}
        if all(v == 0 for by_name in gauges.values() for v in by_name.values()):
            return gauges
        if time.monotonic() > deadline:
            return gauges
        time.sleep(0.5)


async def warm_up(base_url: str, rng: random.Random, rounds: int) -> None:
    """A little of every kind of traffic, so the edge's lazily built state exists before the
    memory baseline is taken."""
    tally = Tally()
    await asyncio.gather(
        *(
            client_loop(base_url, random.Random(rng.random()), time.monotonic() + rounds, tally)
            for _ in range(4)
        )
    )


def report(tally: Tally, checks: list[tuple[str, bool, str]], duration: float, seed: int) -> bool:
    print(f"\nchaos run: {duration:.0f} s, seed {seed}")
    print("worker chaos: " + (", ".join(f"{a} x{n}" for a, n in sorted(tally.actions.items())) or "none"))
    by_kind: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for outcome in tally.outcomes:
        by_kind[outcome.kind][outcome.result] += 1
    print(f"client requests: {len(tally.outcomes)}")
    for kind in KINDS:
        results = by_kind.get(kind, collections.Counter())
        shown = ", ".join(f"{result} {count}" for result, count in results.most_common())
        print(f"  {kind:<18} {sum(results.values()):>5}: {shown}")
    failures = [o for o in tally.outcomes if not o.ok]
    for outcome in failures[:10]:
        print(f"  FAILED {outcome.kind}: {outcome.result} {outcome.detail[:300]!r}")
    checks = [
        (
            "every client got a complete stream, an error event + [DONE], or a clean error",
            not failures,
            f"{len(failures)} failed",
        ),
        *checks,
    ]
    print("checks:")
    for name, passed, detail in checks:
        print(f"  [{'PASS' if passed else 'FAIL'}] {name}" + (f" ({detail})" if detail else ""))
    return all(passed for _, passed, _ in checks)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--duration", type=float, default=180.0, help="seconds of chaos")
    add("--clients", type=int, default=6, help="concurrent client loops")
    add("--seed", type=int, default=None, help="random seed (default: random, printed)")
    add("--real-model", action="store_true", help="serve the default model instead of fake tokens")
    add("--fake-step-ms", type=float, default=30.0, help="fake workers: milliseconds per step")
    add("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR, help="workers' model cache")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.randrange(10**6)
    rng = random.Random(seed)
    logs = Path(tempfile.mkdtemp(prefix="sluice-chaos-"))
    extra = ["--served-model-name", MODEL, "--torch-threads", "1", "--grace-period", "2"]
    if not args.real_model:
        extra += ["--fake-tokens", "--fake-step-ms", str(args.fake_step_ms)]
    tally = Tally()
    with contextlib.ExitStack() as stack:
        workers = []
        for name in ("victim", "survivor"):
            (logs / name).mkdir()
            workers.append(
                stack.enter_context(WorkerProcess(cache_dir=args.cache_dir, log_dir=logs / name, extra=extra))
            )
        victim, survivor = workers
        edge = stack.enter_context(EdgeProcess([w.address for w in workers], log_dir=logs))
        assert edge.proc is not None
        print(f"workers {victim.address} (victim), {survivor.address} (survivor); edge {edge.base_url}")
        print(f"logs in {logs}")
        asyncio.run(warm_up(edge.base_url, rng, 10))
        rss_start = rss_kib(edge.proc.pid)

        async def chaos() -> None:
            until = time.monotonic() + args.duration
            abuse = asyncio.create_task(asyncio.to_thread(worker_chaos, victim, rng, until, tally))
            await asyncio.gather(
                *(
                    client_loop(edge.base_url, random.Random(rng.random()), until, tally)
                    for _ in range(args.clients)
                )
            )
            await abuse

        started = time.monotonic()
        asyncio.run(chaos())
        ran_s = time.monotonic() - started
        # The victim may be stopped or mid-restart when time is up: make sure it is back.
        victim.signal(signal.SIGCONT)
        if victim.proc is None or victim.proc.poll() is not None:
            victim.launch()
        victim.wait_ready()
        checks: list[tuple[str, bool, str]] = []
        with httpx.Client(base_url=edge.base_url, timeout=30) as client:
            health = client.get("/health").status_code
            served = False
            for _ in range(40):  # the edge takes the victim back within its health interval
                response = client.post("/v1/chat/completions", json=chat_body(rng, stream=False))
                served = response.status_code == 200
                if served:
                    break
                time.sleep(0.5)
        checks.append(("the edge answers /health and serves a request", health == 200 and served, ""))
        checks.append(("the surviving worker answers its health check", grpc_serving(survivor.address), ""))
        gauges = wait_idle(workers, 30.0)
        idle = all(v == 0 for by_name in gauges.values() for v in by_name.values())
        shown = "; ".join(
            f"{address}: "
            + ", ".join(f"{k.removeprefix('sluice_worker_')}={v:g}" for k, v in by_name.items())
            for address, by_name in gauges.items()
        )
        checks.append(("nothing left running in any worker", idle, shown))
        time.sleep(2.0)  # let the edge drop what the last requests held
        rss_end = rss_kib(edge.proc.pid)
        change = (rss_end - rss_start) / rss_start
        checks.append(
            (
                "edge RSS back within 10 % of the start",
                abs(change) <= RSS_TOLERANCE,
                f"{rss_start / 1024:.1f} MiB after warm-up, {rss_end / 1024:.1f} MiB at the end "
                f"({change:+.1%})",
            )
        )
        passed = report(tally, checks, ran_s, seed)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
