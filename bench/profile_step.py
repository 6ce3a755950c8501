"""Host time per engine step, with no model: where the engine thread's time goes besides the forward.

Usage::

    python bench/profile_step.py --rows 1,16 --tokens 256
    PYTHONPATH=/path/to/older/checkout python bench/profile_step.py   # the same on older code

Runs the engine in this process on ``--fake-tokens``' runner (worker/model/fake_runner.py: logits
without a model, so a step's time is all host work: scheduling, sampling, token-level stops
and, in engines before the output processor existed, detokenizing, stop strings, parsing and
event building). For each row count R, R greedy requests of ``--tokens`` tokens run at once.
Printed per R: steps, engine-thread time per step inside ``Engine._step`` (mean and p95), and,
where the engine has one, the output processing time per step spent on the event loop
(``RequestStream._process``), which overlaps the next step.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))  # after PYTHONPATH, so an older checkout given there wins

import torch  # noqa: E402

from worker import config as worker_config  # noqa: E402
from worker.engine import core as engine_module  # noqa: E402
from worker.engine.core import Engine  # noqa: E402
from worker.model.fake_runner import FakeRunner, load_fake_model  # noqa: E402
from worker.server import eos_token_ids  # noqa: E402
from worker.types import GenerationRequest, SamplingOptions  # noqa: E402


def timed(owner: Any, name: str, sink: list[float]) -> None:
    original = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            sink.append(time.perf_counter() - start)

    setattr(owner, name, wrapper)


async def run(engine: Engine, rows: int, tokens: int) -> None:
    async def one(i: int) -> None:
        request = GenerationRequest(
            f"p{rows}-{i}",
            (1, 2, 3, 4, 5, 6, 7, 8),
            SamplingOptions(temperature=0.0, max_tokens=tokens, min_tokens=tokens, ignore_eos=True),
            time.monotonic(),
        )
        async for _ in engine.submit(request):
            pass

    await asyncio.gather(*[one(i) for i in range(rows)])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", default="1,16")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    # An older checkout (PYTHONPATH) may not have DEFAULT_CACHE_DIR: then pass --cache-dir.
    parser.add_argument("--cache-dir", type=Path, default=getattr(worker_config, "DEFAULT_CACHE_DIR", None))
    args = parser.parse_args()
    if args.cache_dir is None:
        parser.error("this checkout has no DEFAULT_CACHE_DIR: pass --cache-dir")
    torch.set_num_threads(1)
    loaded = load_fake_model(None, served_model_name=None, cache_dir=args.cache_dir)
    print(f"engine from {Path(engine_module.__file__).resolve().parent.parent}")
    for rows in [int(r) for r in args.rows.split(",")]:
        step_times: list[list[float]] = []
        process_times: list[float] = []
        for _ in range(args.rounds):
            steps: list[float] = []
            # Older checkouts' FakeRunner takes no pool size (their KV cache was not paged).
            try:
                runner = FakeRunner(loaded, num_blocks=1 << 16, block_size=16)  # type: ignore[call-arg]
            except TypeError:
                runner = FakeRunner(loaded)  # type: ignore[call-arg]
            engine = Engine(
                runner,
                loaded.tokenizer,
                eos_token_ids=eos_token_ids(loaded.model, loaded.tokenizer),
                context_length=loaded.context_length,
                max_running=max(rows, 1),
            )
            timed(engine, "_step", steps)
            stream_class = getattr(engine_module, "RequestStream", None)
            restore = getattr(stream_class, "_process", None)
            processed: list[float] = []
            if restore is not None:
                timed(stream_class, "_process", processed)
            engine.start()
            try:
                asyncio.run(run(engine, rows, args.tokens))
            finally:
                engine.stop()
                if restore is not None:
                    stream_class._process = restore  # type: ignore[union-attr]
            step_times.append(steps)
            if steps:
                process_times.append(sum(processed) / len(steps))
        best = min(step_times, key=lambda s: statistics.mean(s))
        mean_ms = statistics.mean(best) * 1e3
        p95_ms = sorted(best)[int(0.95 * (len(best) - 1))] * 1e3
        line = f"rows {rows:3d}: {len(best)} steps, engine thread {mean_ms:.2f} ms/step (p95 {p95_ms:.2f})"
        if process_times:
            line += f", output processing on the event loop {min(process_times) * 1e3:.2f} ms/step"
        print(line)


if __name__ == "__main__":
    main()
