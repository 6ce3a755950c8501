"""How often a later conversation turn is served from the worker's prefix cache, per routing policy.

Two workers (the default model, default settings: prefix cache on) behind one
edge; for each ``--routing`` policy a fresh pair of workers (empty caches) and
an edge run ``--conversations`` chat conversations of ``--turns`` turns,
``--parallel`` at a time (tests/conversations.py: a shared short system
prompt, a long first question per conversation, short follow-ups; greedy,
``--max-tokens`` per answer). Printed per policy: the fraction of the turns
after the first that had at least half their prompt tokens cached
(``usage.prompt_tokens_details.cached_tokens``), the mean cached share of
those turns, and how the conversations' turns spread over the workers.

The bar (issue 18): with two workers and 20 conversations of 4 turns,
prefix-affinity >= 90 %; least-outstanding gives about two thirds.

``--parallel 1`` (the default) runs one conversation at a time: every request
finds both workers idle, so least-outstanding's round-robin tie break sends a
conversation's turns to alternating workers. With several conversations in
flight (``--parallel 4``) the closed loop makes least-outstanding sticky by
accident: a conversation's next turn is sent the moment its previous one
ended, when its own worker has just become the less loaded one.

    python bench/bench_routing.py
    python bench/bench_routing.py --conversations 8 --turns 3 --policies prefix-affinity
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from edge.workers.routing import RoutingPolicy  # noqa: E402
from tests.conversations import Turn, cached_fraction, run_conversations  # noqa: E402
from tests.processes import EdgeProcess, WorkerProcess  # noqa: E402
from worker.config import DEFAULT_CACHE_DIR  # noqa: E402


def measure(policy: str, args: argparse.Namespace, log_dir: Path) -> list[Turn]:
    """Runs the conversations through a fresh pair of workers and an edge with ``policy``."""
    extra = ["--torch-threads", str(args.torch_threads)]
    for name in ("a", "b", "edge"):
        (log_dir / name).mkdir(parents=True)
    with (
        WorkerProcess(
            cache_dir=args.cache_dir, log_dir=log_dir / "a", extra=[*extra, "--worker-id", "a"]
        ) as a,
        WorkerProcess(
            cache_dir=args.cache_dir, log_dir=log_dir / "b", extra=[*extra, "--worker-id", "b"]
        ) as b,
        EdgeProcess([a.address, b.address], log_dir=log_dir / "edge", extra=["--routing", policy]) as edge,
    ):
        return asyncio.run(
            run_conversations(
                edge.base_url,
                conversations=args.conversations,
                turns=args.turns,
                parallel=args.parallel,
                max_tokens=args.max_tokens,
            )
        )


def report(policy: str, turns: list[Turn], seconds: float) -> None:
    later = [t for t in turns if t.turn > 0]
    share = sum(t.cached_tokens / t.prompt_tokens for t in later) / len(later)
    spread = Counter(t.worker_id for t in turns)
    moved = sum(
        1
        for t in later
        if t.worker_id != next(u.worker_id for u in turns if u.conversation == t.conversation and u.turn == 0)
    )
    print(
        f"{policy:>18}: {cached_fraction(turns):6.1%} of later turns mostly cached "
        f"({sum(t.mostly_cached for t in later)}/{len(later)}), mean cached share {share:.1%}, "
        f"turns per worker {dict(sorted(spread.items()))}, later turns off their first worker {moved}, "
        f"{seconds:.0f} s",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--conversations", type=int, default=20)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--parallel", type=int, default=1, help="conversations in flight at once")
    parser.add_argument("--max-tokens", type=int, default=2)
    parser.add_argument("--torch-threads", type=int, default=1, help="per worker")
    parser.add_argument(
        "--policies", default=",".join(RoutingPolicy), help="comma-separated --routing values"
    )
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR)
    args = parser.parse_args()
    print(
        f"two workers, {args.conversations} conversations x {args.turns} turns, {args.parallel} at a time, "
        f"max_tokens {args.max_tokens}",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="bench-routing-") as logs:
        for policy in args.policies.split(","):
            started = time.monotonic()
            turns = measure(policy, args, Path(logs) / policy)
            report(policy, turns, time.monotonic() - started)


if __name__ == "__main__":
    main()
