"""What ``--speculative ngram`` gives: the default model's engine in-process with and without it.

Loads the default model once (``--quantization``, int4 by default: what the worker serves on the
CPU) and builds two engines over it, one speculating. Greedy, one stream at a time: (a) an
input-grounded prompt (copy a paragraph), (b) open chat; decode tok/s (first to last token),
acceptance; then ``--streams`` concurrent greedy streams of both prompts: total tok/s. The two
engines alternate within each of ``--rounds`` rounds. Prints one table of figures from this run
(medians over the rounds), the ratio speculative / plain, and whether the texts matched.

    python bench/bench_speculative.py
    python bench/bench_speculative.py --tokens 128 --streams 16 --threads 2
    python bench/bench_speculative.py --batch-invariant --rounds 1 --streams 4 --tokens 64
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from worker.engine.core import Engine  # noqa: E402
from worker.engine.options import EngineOptions  # noqa: E402
from worker.engine.speculation import Speculation  # noqa: E402
from worker.model.loader import load_model  # noqa: E402
from worker.model.runner import ModelRunner  # noqa: E402
from worker.server import eos_token_ids  # noqa: E402
from worker.types import ContentDelta, Finished, GenerationRequest, SamplingOptions  # noqa: E402

PARAGRAPH = (
    "Sluice keeps one worker per model and puts an edge in front of the workers. The edge speaks "
    "the public APIs, checks every request, and streams tokens back as the worker produces them. "
    "The worker batches the requests of many callers into each forward pass, keeps their keys and "
    "values in a paged cache, and reuses the cached blocks of prompts it has already seen."
)
PROMPTS = {
    "input-grounded (copy)": f"Repeat the following text exactly, word for word:\n\n{PARAGRAPH}",
    "open chat": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}


def engine(loaded, speculation: Speculation | None, streams: int, invariant: bool) -> Engine:  # type: ignore[no-untyped-def]
    eng = Engine(
        ModelRunner(loaded, num_blocks=streams * 48, block_size=16, batch_invariant=invariant),
        loaded.tokenizer,
        eos_token_ids=eos_token_ids(loaded.model, loaded.tokenizer),
        context_length=loaded.context_length,
        options=EngineOptions(max_running=streams, max_queue=4 * streams, prefill_budget_tokens=512),
        speculation=speculation,
    )
    eng.start()
    return eng


def chat(loaded, text: str) -> tuple[int, ...]:  # type: ignore[no-untyped-def]
    rendered = loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    return tuple(loaded.tokenizer(rendered, add_special_tokens=False)["input_ids"])


async def one(eng: Engine, prompt: tuple[int, ...], tokens: int) -> tuple[str, int, float, float]:
    """Text, completion tokens, first and last token times."""
    request = GenerationRequest(
        f"bench-{time.monotonic_ns()}",
        prompt,
        SamplingOptions(temperature=0.0, max_tokens=tokens),
        time.monotonic(),
    )
    text, first, last, count = [], 0.0, 0.0, 0
    async for event in eng.submit(request):
        if isinstance(event, ContentDelta):
            now = time.perf_counter()
            first = first or now
            last = now
            text.append(event.text)
        elif isinstance(event, Finished):
            count = event.completion_tokens
    return "".join(text), count, first, last


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quantization", default="int4", choices=("int4", "int8", "none"))
    parser.add_argument("--tokens", type=int, default=128, help="max_tokens of each request")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-invariant", action="store_true", help="both engines batch-invariant")
    parser.add_argument("--speculative-tokens", type=int, default=4)
    parser.add_argument("--ngram-min", type=int, default=2)
    parser.add_argument("--ngram-max", type=int, default=3)
    parser.add_argument(
        "--max-rows", type=int, default=0, help="--speculative-max-rows (0: any step speculates)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(None, device="cpu", quantization=args.quantization)
    spec = Speculation(args.speculative_tokens, args.ngram_min, args.ngram_max, args.max_rows or None)
    engines = {
        "plain": engine(loaded, None, args.streams, args.batch_invariant),
        "ngram": engine(loaded, spec, args.streams, args.batch_invariant),
    }
    prompts = {name: chat(loaded, text) for name, text in PROMPTS.items()}
    mixed = [prompts[name] for name in PROMPTS] * (args.streams // 2)
    cases = {f"1 stream, {name}": [prompt] for name, prompt in prompts.items()}
    cases[f"{len(mixed)} streams, both prompts"] = mixed
    rates: dict[tuple[str, str], list[float]] = {}
    tallies = {name: [0, 0] for name in cases}  # accepted, proposed
    same = dict.fromkeys(cases, True)

    async def case(name: str, batch: list[tuple[int, ...]]) -> None:
        texts = {}
        for kind, eng in engines.items():
            before = eng.stats().counters
            started = time.perf_counter()
            results = await asyncio.gather(*(one(eng, p, args.tokens) for p in batch))
            if len(batch) == 1:
                _, count, first, last = results[0]
                rate = (count - 1) / (last - first)
            else:
                rate = sum(r[1] for r in results) / (time.perf_counter() - started)
            rates.setdefault((name, kind), []).append(rate)
            texts[kind] = [r[0] for r in results]
            after = eng.stats().counters
            tallies[name][0] += after.speculative_accepted_tokens - before.speculative_accepted_tokens
            tallies[name][1] += after.speculative_proposed_tokens - before.speculative_proposed_tokens
        same[name] = same[name] and texts["plain"] == texts["ngram"]

    async def run() -> None:
        for eng in engines.values():  # warm-up
            await one(eng, prompts["open chat"], 8)
        for _ in range(args.rounds):
            for name, batch in cases.items():
                await case(name, batch)

    try:
        asyncio.run(run())
    finally:
        for eng in engines.values():
            eng.stop()
    print(
        f"default model ({args.quantization}), {args.threads} threads, greedy, max_tokens {args.tokens}, "
        f"medians of {args.rounds} rounds, batch-invariant {args.batch_invariant}, "
        f"--num-speculative-tokens {args.speculative_tokens}, "
        f"n-gram {args.ngram_min}..{args.ngram_max}, max rows {args.max_rows or 'any'}"
    )
    print_table(cases, rates, tallies, same, "ngram tok/s")
    return 0


def print_table(
    cases: Sequence[str],
    rates: dict[tuple[str, str], list[float]],
    tallies: dict[str, list[int]] | dict[str, list[float]],
    same: dict[str, bool],
    column: str,
) -> None:
    """The markdown table of docs/benchmarks.md: per case the median plain and speculating tok/s
    (``rates[(case, "plain" | "ngram")]``), their ratio, the accepted/proposed tally and whether
    the texts were the same."""
    print(f"| case | plain tok/s | {column} | ratio | accepted/proposed | same text |")
    print("|---|---|---|---|---|---|")
    for name in cases:
        plain = statistics.median(rates[(name, "plain")])
        fast = statistics.median(rates[(name, "ngram")])
        taken, proposed = (int(v) for v in tallies[name])
        acceptance = f"{taken}/{proposed} = {taken / max(1, proposed):.0%}"
        same_text = "yes" if same[name] else "no"
        print(f"| {name} | {plain:.1f} | {fast:.1f} | {fast / plain:.2f}x | {acceptance} | {same_text} |")


if __name__ == "__main__":
    raise SystemExit(main())
