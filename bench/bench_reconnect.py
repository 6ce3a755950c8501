"""How long the edge takes to route to a worker restarted on the same address after an outage.

For each absence (default 60 s and 180 s, run side by side, each with its own
worker and edge on 127.0.0.1): a ``--fake-tokens`` worker serves behind an
edge with default settings; it is SIGKILLed, stays down for the absence, and is
restarted on the same port. Printed per absence:

- ``restart -> health``: from the restart until the worker's own health check
  answers SERVING (asked on a fresh channel every 0.1 s);
- ``health -> routed``: from that answer until the edge first serves a request
  with it (a short completion every 0.1 s; the edge answers 503 until then).

The bar (issue 17): ``health -> routed`` within 15 s. gRPC's own reconnect
backoff grows to 120 s during a long outage; see docs/operations.md for the
figures and what bounds them.

    python bench/bench_reconnect.py                    # 60 s and 180 s
    python bench/bench_reconnect.py --absence 30 --repeat 3
"""

from __future__ import annotations

import argparse
import concurrent.futures
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.processes import EdgeProcess, WorkerProcess  # noqa: E402
from worker.config import DEFAULT_CACHE_DIR  # noqa: E402

POLL_S = 0.1


@dataclass(frozen=True)
class Trial:
    absence_s: float
    restart_to_health_s: float
    health_to_routed_s: float


def completion_ok(client: httpx.Client) -> bool:
    try:
        response = client.post("/v1/completions", json={"model": "fake", "prompt": "hi", "max_tokens": 1})
    except httpx.HTTPError:
        return False
    return response.status_code == 200


def one_trial(absence_s: float, cache_dir: Path, log_dir: Path) -> Trial:
    log_dir.mkdir(parents=True, exist_ok=True)
    extra = ["--fake-tokens", "--served-model-name", "fake", "--torch-threads", "1"]
    worker = WorkerProcess(cache_dir=cache_dir, log_dir=log_dir, extra=extra)
    with (
        worker,
        EdgeProcess([worker.address], log_dir=log_dir) as edge,
        httpx.Client(base_url=edge.base_url, timeout=10) as client,
    ):
        if not completion_ok(client):
            raise SystemExit(f"the edge does not serve before the outage; see {log_dir}")
        worker.kill()
        # The edge notices at its next health check; wait until it answers 503.
        while completion_ok(client):
            time.sleep(POLL_S)
        time.sleep(absence_s)
        restarted = time.monotonic()
        worker.start()  # returns once the worker's own health check answers SERVING
        healthy = time.monotonic()
        while not completion_ok(client):
            time.sleep(POLL_S)
        routed = time.monotonic()
    return Trial(absence_s, healthy - restarted, routed - healthy)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--absence", default="60,180", help="comma-separated outage lengths, seconds")
    parser.add_argument("--repeat", type=int, default=1, help="trials per absence (all run side by side)")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR, help="workers' model cache")
    args = parser.parse_args(argv)
    absences = [float(a) for a in args.absence.split(",") if a.strip()] * args.repeat
    logs = Path(tempfile.mkdtemp(prefix="sluice-reconnect-"))
    with concurrent.futures.ThreadPoolExecutor(len(absences)) as pool:
        futures = [
            pool.submit(one_trial, absence, args.cache_dir, logs / f"trial{i}")
            for i, absence in enumerate(absences)
        ]
        trials = [future.result() for future in futures]
    print(f"{'absence':>8} | {'restart -> health':>17} | {'health -> routed':>16}")
    for trial in sorted(trials, key=lambda t: t.absence_s):
        print(
            f"{trial.absence_s:>7.0f}s | {trial.restart_to_health_s:>16.2f}s | "
            f"{trial.health_to_routed_s:>15.2f}s"
        )
    print(f"(logs in {logs})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
