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
(``RequestStream._process``), which overlaps the next step, and the CPU time each takes (the wall
time counts waits for the GIL, the CPU time does not); ``--step-ms`` gives each forward that much
time on a notional device that runs beside the host, as a GPU does (the engine waits for it only
where it reads a draw), and ``--overlap`` lets the steps overlap; ``--engine-vocab 64`` narrows the fake
logits so that the sampler's tensor math (a device's on a GPU) is negligible and what is timed is
the host's. ``--part output`` times one streamed choice's output path per token (detokenizing
with the default model's tokenizer, stop strings, events, conversion to the wire). ``--part host``
times instead the host
work of a sampled decode step without model or engine: decode inputs and sampling (temperature,
top_p, repetition penalty, a grammar mask) over a ``--vocab`` of 32 tokens, so tensor math (device
work on a GPU) is negligible and what is timed is the host's.
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
from worker.engine.options import EngineOptions  # noqa: E402
from worker.model.fake_runner import FakeRunner, load_fake_model  # noqa: E402
from worker.server import eos_token_ids  # noqa: E402
from worker.types import GenerationRequest, SamplingOptions  # noqa: E402


def timed(owner: Any, name: str, sink: list[float], cpu: list[float] | None = None) -> None:
    """Wraps ``owner.name`` to append each call's wall time to ``sink`` and its thread's CPU time
    to ``cpu`` (which waiting for the GIL does not count)."""
    original = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start, start_cpu = time.perf_counter(), time.thread_time()
        try:
            return original(*args, **kwargs)
        finally:
            sink.append(time.perf_counter() - start)
            if cpu is not None:
                cpu.append(time.thread_time() - start_cpu)

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


class _AllowAll:
    """A grammar stand-in that allows every token (its mask is what the sampler applies)."""

    def __init__(self, vocab: int):
        self.mask_words = -(-vocab // 32)

    def fill_mask(self, row: torch.Tensor) -> None:
        row.fill_(-1)

    def advance(self, token_id: int) -> None:
        pass


def host_step_times(rows: int, steps: int, vocab: int = 32, context: int = 512) -> list[float]:
    """Seconds per step of a sampled decode step's host work at ``rows`` rows (no model)."""
    from worker.model import step_inputs
    from worker.sampling.sampler import SequenceSampling, sample_batch

    block = 16
    rng = torch.Generator().manual_seed(0)
    tables = [torch.randperm(1 << 16, generator=rng)[:128].tolist() for _ in range(rows)]
    options = SamplingOptions(temperature=0.8, top_p=0.9, repetition_penalty=1.1, seed=1)
    prompt = tuple(torch.randint(0, vocab, (context,), generator=rng).tolist())
    sampling = [SequenceSampling(options, prompt, frozenset(), seed_offset=i) for i in range(rows)]
    for row in sampling:
        row.constraint = _AllowAll(vocab)  # type: ignore[assignment]
    logits = torch.randn((rows, vocab), generator=rng)
    cpu = torch.device("cpu")
    times = []
    for step in range(steps):
        start = time.perf_counter()
        work = [step_inputs.Work((5,), context + step, tables[i], True, step) for i in range(rows)]
        if hasattr(step_inputs, "decode_inputs"):
            step_inputs.decode_inputs(work, block, cpu, torch.long)
        else:  # the runner's code before decode_inputs existed
            width = -(-max(w.start + 1 for w in work) // block)
            step_inputs.decode_tables(work, block, rows, width, torch.long)
            torch.tensor([w.start + 1 for w in work], dtype=torch.long, device=cpu)
            flat = [s for w in work for s in step_inputs.slots(w, block)]
            torch.tensor(flat, dtype=torch.long, device=cpu)
            torch.tensor([[w.tokens[0]] for w in work], dtype=torch.long, device=cpu)
            torch.tensor([[w.start] for w in work], dtype=torch.long, device=cpu)
        for row, sample in zip(sampling, sample_batch(logits, sampling), strict=True):
            row.record(sample.token_id)
        times.append(time.perf_counter() - start)
    return times


def model_step_times(model: str, device: str, rows_list: list[int], tokens: int, trace: int = 0) -> None:
    """The real engine on ``model`` (``--model``): per step, where the engine thread's time goes
    (planning, the forward's launch, waiting for the device, sampling, publishing) and the output
    processing on the event loop, and the CPU time of the step, the launch and the processing (a
    wall time well above its CPU time is waiting: for the GIL, or on the device). The wait is a
    ``synchronize`` before sampling, so the step's host work and its device time are told apart;
    "read" is reading the previous draw (with the overlap, the CUDA default, while this step's
    forward runs, and before the wait). ``trace``: then ``trace`` steps at the most rows under
    torch's profiler, its busiest operators by host time and by device time printed."""
    from worker.config import parse_config
    from worker.engine.request_stream import RequestStream
    from worker.model.runner import ModelRunner
    from worker.server import build_serving

    max_rows = max(rows_list)
    config = parse_config(["--model", model, "--device", device, "--max-running", str(max_rows),
                           "--max-queue", str(max(4096, max_rows))], environ={})  # fmt: skip
    serving = build_serving(config)
    engine = serving.engine
    sinks: dict[str, list[float]] = {name: [] for name in ("step", "plan", "launch", "wait", "sample",
                                                           "read", "publish", "process")}  # fmt: skip
    # CPU time of the step, the launch and the output processing: their wall time less this is time
    # spent waiting (for the GIL, or in a blocking device call).
    cpu: dict[str, list[float]] = {name: [] for name in ("step", "launch", "process")}
    timed(engine, "_step", sinks["step"], cpu["step"])
    timed(engine, "_next_plan", sinks["plan"])
    timed(ModelRunner, "execute", sinks["launch"], cpu["launch"])
    timed(
        engine._update, "resolve", sinks["read"]
    )  # reading a draw (with the overlap: during the next forward)
    timed(engine._update, "publish", sinks["publish"])
    timed(RequestStream, "_process", sinks["process"], cpu["process"])
    sample = engine._update.sample
    wait_sink, sample_sink = sinks["wait"], sinks["sample"]

    def waited_sample(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        middle = time.perf_counter()
        try:
            return sample(*args, **kwargs)
        finally:
            wait_sink.append(middle - start)
            sample_sink.append(time.perf_counter() - middle)

    engine._update.sample = waited_sample  # type: ignore[method-assign]
    try:
        for rows in rows_list:
            asyncio.run(run(engine, rows, 16))  # warm-up at this size
            for sink in [*sinks.values(), *cpu.values()]:
                sink.clear()
            started = time.perf_counter()
            asyncio.run(run(engine, rows, tokens))
            wall = time.perf_counter() - started
            steps = max(len(sinks["step"]), 1)
            parts = ", ".join(f"{name} {sum(sink) / steps * 1e3:.2f}" for name, sink in sinks.items())
            cpu_parts = ", ".join(f"{name} {sum(sink) / steps * 1e3:.2f}" for name, sink in cpu.items())
            print(f"rows {rows:3d}: {steps} steps, {rows * tokens / wall:,.0f} tok/s, "
                  f"ms per step: {parts}; of which CPU: {cpu_parts}", flush=True)  # fmt: skip
        if trace:
            print_trace(engine, max_rows, trace, device)
    finally:
        engine.stop()


def print_trace(engine: Engine, rows: int, steps: int, device: str) -> None:
    """Runs ``steps`` decode steps of ``rows`` requests (after their prompts' steps) under torch's
    profiler, started and stopped on the engine's thread (it records the thread it was started on),
    and prints the operators that took the most host time and the kernels that took the most device
    time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.startswith("cuda"):
        activities.append(ProfilerActivity.CUDA)
    traced = profile(activities=activities)
    step = engine._step
    done = 0
    skip = 3  # the prompts' steps (8-token prompts: 2,048 tokens at 256 rows, one CUDA step's budget)

    def profiled_step(*args: Any, **kwargs: Any) -> Any:
        nonlocal done
        if done == skip:
            traced.start()
        try:
            return step(*args, **kwargs)
        finally:
            done += 1
            if done == skip + steps:
                traced.stop()

    engine._step = profiled_step  # type: ignore[method-assign]
    try:
        asyncio.run(run(engine, rows, skip + steps + 4))  # a few steps more than traced
    finally:
        engine._step = step  # type: ignore[method-assign]
    averages = traced.key_averages()
    print(f"{steps} decode steps of {rows} rows under torch's profiler:")
    print(averages.table(sort_by="self_cpu_time_total", row_limit=30), flush=True)
    if device.startswith("cuda"):
        print(averages.table(sort_by="self_device_time_total", row_limit=20), flush=True)


OUTPUT_TEXT = "The lighthouse keeper counted 12 ships; Ünïcödé, 日本語, emoji 🐉 and code: x ** 2.\n"


def output_path_us(tokenizer: Any, tokens: int) -> float:
    """Microseconds per token of one streamed choice's output path on the serving thread: the
    output processor (detokenizing, stop strings, events), coalescing, conversion to the wire,
    with token ids asked for as the edge asks; the best of five passes over ``tokens`` tokens."""
    from worker.output.detokenizer import TokenTexts, fast_decoder
    from worker.output.processor import RequestOutputProcessor, TextRules, coalesce
    from worker.service.convert import event_to_proto
    from worker.types import NewToken

    ids = tokenizer(OUTPUT_TEXT * (1 + tokens // 8), add_special_tokens=False)["input_ids"][:tokens]
    prompt = tuple(tokenizer("Tell me a story.", add_special_tokens=False)["input_ids"])
    decoder, texts, sampling = (
        fast_decoder(tokenizer),
        TokenTexts(tokenizer),
        SamplingOptions(max_tokens=1 << 20),
    )
    best = float("inf")
    for _ in range(5):
        request = GenerationRequest("r", prompt, sampling, 0.0, return_token_ids=True)
        processor = RequestOutputProcessor(request, decoder, texts, TextRules())
        started = time.perf_counter()
        for token in ids:
            for event in coalesce(processor.process([NewToken(0, token, 0.0)]).events):
                event_to_proto(event)
        best = min(best, time.perf_counter() - started)
    return best / len(ids) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", default="1,16")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--part", choices=("engine", "host", "output"), default="engine")
    parser.add_argument("--vocab", type=int, default=32, help="--part host: the logits' vocabulary")
    parser.add_argument(
        "--engine-vocab", type=int, default=0, help="--part engine: logits this wide (0: the tokenizer's)"
    )
    parser.add_argument(
        "--step-ms", type=float, default=0.0, help="--part engine: a notional device's time per forward"
    )
    parser.add_argument(
        "--overlap", action="store_true", help="--part engine: steps overlap (--overlap-steps on)"
    )
    parser.add_argument("--model", help="profile the real engine on this model folder instead (a device)")
    parser.add_argument("--device", default="cuda", help="--model: the worker's --device")
    parser.add_argument(
        "--trace", type=int, default=0, help="--model: then this many steps under torch's profiler"
    )
    # An older checkout (PYTHONPATH) may not have DEFAULT_CACHE_DIR: then pass --cache-dir.
    parser.add_argument("--cache-dir", type=Path, default=getattr(worker_config, "DEFAULT_CACHE_DIR", None))
    args = parser.parse_args()
    if args.cache_dir is None:
        parser.error("this checkout has no DEFAULT_CACHE_DIR: pass --cache-dir")
    if args.model:
        rows = [int(r) for r in args.rows.split(",")]
        model_step_times(args.model, args.device, rows, args.tokens, args.trace)
        return
    torch.set_num_threads(1)
    if args.part == "host":
        for rows in [int(r) for r in args.rows.split(",")]:
            best = min(
                (host_step_times(rows, args.tokens, args.vocab) for _ in range(args.rounds)),
                key=statistics.mean,
            )
            p95_ms = sorted(best)[int(0.95 * (len(best) - 1))] * 1e3
            print(f"rows {rows:3d}: host work {statistics.mean(best) * 1e3:.2f} ms/step (p95 {p95_ms:.2f})")
        return
    loaded = load_fake_model(None, served_model_name=None, cache_dir=args.cache_dir)
    if args.part == "output":
        for _ in range(args.rounds):
            print(f"output path: {output_path_us(loaded.tokenizer, args.tokens):.2f} us per token")
        return
    print(f"engine from {Path(engine_module.__file__).resolve().parent.parent}")
    for rows in [int(r) for r in args.rows.split(",")]:
        rounds: list[tuple[list[float], float, float, float]] = []  # steps, engine CPU, process CPU, tok/s
        for _ in range(args.rounds):
            steps: list[float] = []
            engine_cpu: list[float] = []
            # Older checkouts' FakeRunner takes no pool size (their KV cache was not paged) or vocab.
            try:
                runner = FakeRunner(  # type: ignore[call-arg]
                    loaded, num_blocks=1 << 16, block_size=16, vocab=args.engine_vocab, step_ms=args.step_ms
                )
            except TypeError:
                try:
                    runner = FakeRunner(loaded, num_blocks=1 << 16, block_size=16)  # type: ignore[call-arg]
                except TypeError:
                    runner = FakeRunner(loaded)  # type: ignore[call-arg]
                if args.engine_vocab:  # narrow logits, as this checkout's FakeRunner does it
                    runner.vocab_size = args.engine_vocab
                    runner._passage = [token % args.engine_vocab for token in runner._passage]
            engine = Engine(
                runner,
                loaded.tokenizer,
                eos_token_ids=eos_token_ids(loaded.model, loaded.tokenizer),
                context_length=loaded.context_length,
                options=EngineOptions(max_running=max(rows, 1), overlap=args.overlap),
            )
            timed(engine, "_step", steps, engine_cpu)
            stream_class = getattr(engine_module, "RequestStream", None)
            restore = getattr(stream_class, "_process", None)
            processed: list[float] = []
            processed_cpu: list[float] = []
            if restore is not None:
                timed(stream_class, "_process", processed, processed_cpu)
            engine.start()
            started = time.perf_counter()
            try:
                asyncio.run(run(engine, rows, args.tokens))
            finally:
                engine.stop()
                if restore is not None:
                    stream_class._process = restore  # type: ignore[union-attr]
            wall = time.perf_counter() - started
            if steps:
                count = len(steps)
                rounds.append(
                    (steps, sum(engine_cpu) / count, sum(processed_cpu) / count, rows * args.tokens / wall)
                )
        best = min(rounds, key=lambda r: statistics.mean(r[0]))
        mean_ms = statistics.mean(best[0]) * 1e3
        p95_ms = sorted(best[0])[int(0.95 * (len(best[0]) - 1))] * 1e3
        print(
            f"rows {rows:3d}: {len(best[0])} steps, engine thread {mean_ms:.2f} ms/step (p95 {p95_ms:.2f}), "
            f"CPU per step (median of {len(rounds)} rounds): engine thread "
            f"{statistics.median(r[1] for r in rounds) * 1e3:.2f} ms, output processing on the event loop "
            f"{statistics.median(r[2] for r in rounds) * 1e3:.2f} ms; "
            f"{statistics.median(r[3] for r in rounds):,.0f} tok/s"
        )


if __name__ == "__main__":
    main()
