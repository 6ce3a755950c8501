"""GPU benchmark: Sluice over gRPC against transformers' continuous batching, one model, one run.

Usage::

    python bench/bench_gpu.py --shape 1.7b                       # H100: the issue-12 table
    python bench/bench_gpu.py --shape 8b --levels 16,256
    python bench/bench_gpu.py --model /models/my-llama --levels 1,64
    python bench/bench_gpu.py --device cpu --shape tiny --levels 1,4   # smoke run on a CPU

The model is a random-weight Llama of a named shape (``--shape``: ``1.7b`` is
SmolLM2-1.7B, ``8b`` a Llama-3-8B body, ``135m`` SmolLM2-135M, ``tiny`` a
2-layer toy for smoke runs) on the default model's tokenizer and chat template,
built once on the device and saved under ``--model-cache``; or any Hugging Face
folder (``--model``). Every stream sends a ~40-token chat prompt of its own and
asks for ``--max-tokens`` (128) greedy tokens; Sluice gets ``ignore_eos`` and the
peers, which have no such switch over HTTP, practically never meet EOS on
random weights (their completion-token counts are what is divided).

Three servers run one after the other, each alone on the device:

1. Sluice: a worker (``--device``, ``--dtype``, ``--max-running`` = the
   largest level unless given, INFO logs so its CUDA-graph line shows), read
   over gRPC. All levels run ``--rounds`` times (2): the first round right
   after start (cold) and the last, measured round. Both are printed, since the bar is
   "the first round within 20 % of the second".
2. transformers ``model.generate_batch`` in this process (its continuous
   batching engine, paged attention), after a 4-prompt warm-up.
3. ``transformers serve --continuous-batching`` over HTTP (needs
   ``transformers[serving]``; skipped with a note where it cannot start).

Printed: one line per measurement as it happens (for Sluice with the CPU the worker's processes
and this client used, bench/cpu_use.py), then the table of
docs/benchmarks.md (tok/s = completion tokens of all streams / wall time of the
level; for one stream also ms per token).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib.util
import shlex
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from bench_worker import (  # noqa: E402
    LevelResult,
    StreamResult,
    merged_flags,
    read_sse_stream,
    read_stream,
    start_peer,
    start_worker,
    stop,
)
from cpu_use import cpu_line, snapshot  # noqa: E402

from sluice.v1 import worker_pb2 as pb  # noqa: E402
from sluice.v1 import worker_pb2_grpc as pb_grpc  # noqa: E402
from worker.config import DEFAULT_CACHE_DIR  # noqa: E402

# Llama bodies by name. The SmolLM2 family shares the default model's 49,152-token vocabulary and
# tied embeddings; "8b" is Llama-3-8B's body (GQA 32/8, untied head) on that same vocabulary.
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, rope_theta=10000.0),
    "135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                 num_key_value_heads=3, rope_theta=100000.0),
    "1.7b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=24, num_attention_heads=32,
                 num_key_value_heads=32, rope_theta=130000.0),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, rope_theta=500000.0, tie_word_embeddings=False),
}  # fmt: skip
SHAPE_NAMES = {
    "tiny": "tiny (2 layers)",
    "135m": "SmolLM2-135M",
    "1.7b": "SmolLM2-1.7B",
    "8b": "Llama-3-8B body",
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
PEERS = ("sluice", "generate_batch", "serve")


def prompt(i: int) -> str:
    """Stream ``i``'s prompt: about 40 tokens with the chat template, distinct from the first words
    (so no two streams share more than the template's prefix)."""
    return (
        f"Request {i}: write a long, detailed story about a lighthouse keeper named Robot-{i} "
        "who discovers a map, and describe every step of the journey."
    )


# ------------------------------------------------------------------ the model


def resolved_dtype(device: str, dtype: str) -> str:
    """The worker's ``auto`` rule, so every server runs the same dtype: bfloat16 on CUDA, else float32."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if device.startswith("cuda") else "float32"


def build_model(shape: str, folder: Path, tokenizer_dir: Path, device: str, dtype: str) -> Path:
    """Saves a random-weight Llama of ``shape`` with ``tokenizer_dir``'s tokenizer into ``folder``
    (once: a folder holding a config is reused). Built directly on ``device`` in ``dtype``, since
    initialising 8B parameters on a CPU takes minutes."""
    if (folder / "config.json").is_file():
        return folder
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    started = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    body = dict(SHAPES[shape])
    rope_theta = body.pop("rope_theta")
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        tie_word_embeddings=body.pop("tie_word_embeddings", True),
        rope_parameters={"rope_theta": rope_theta, "rope_type": "default"},
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **body,
    )
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    params = save_with_tokenizer(model, folder, tokenizer_dir)
    del model
    print(f"built {shape}: {params:.0f}M parameters in {time.monotonic() - started:.1f} s -> {folder}")
    return folder


def save_with_tokenizer(model: Any, folder: Path, tokenizer_dir: Path) -> float:
    """Saves ``model`` with ``tokenizer_dir``'s tokenizer files into ``folder``; its millions of
    parameters. A run killed while saving leaves no half model behind (a ``.partial`` folder)."""
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, partial / name)
    partial.rename(folder)
    return sum(p.numel() for p in model.parameters()) / 1e6


def default_tokenizer_dir(cache_dir: Path) -> Path:
    """The default model's converted folder (tokenizer and chat template), converting it once."""
    from worker.model.loader import converted_gguf_folder, default_gguf_path

    return converted_gguf_folder(default_gguf_path(), cache_dir)


# ------------------------------------------------------------------ Sluice over gRPC


def sluice_request(i: int, max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        chat=pb.ChatInput(messages=[pb.ChatMessage(role="user", content=prompt(i))]),
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
    )


async def sluice_rounds(
    address: str,
    levels: list[int],
    max_tokens: int,
    count: int = 2,
    worker_pid: int | None = None,
    connections: int = 1,
) -> tuple[dict[int, float], dict[int, float]]:
    """Runs every level ``count`` times on a fresh worker; returns tok/s per level for the first
    and the last round. With the worker's pid, each level is followed by the CPU its processes
    and this client used. Streams go round-robin over ``connections`` connections of their own
    (which the kernel spreads over a worker's serving processes, ``--api-server-count``)."""
    rounds: list[dict[int, float]] = [{} for _ in range(max(2, count))]
    options = [("grpc.max_receive_message_length", 64 << 20), ("grpc.use_local_subchannel_pool", 1)]
    channels = [grpc.aio.insecure_channel(address, options=options) for _ in range(connections)]
    try:
        stubs = [pb_grpc.WorkerStub(channel) for channel in channels]
        for round_, by_level in enumerate(rounds, start=1):
            for c in levels:
                before = snapshot(worker_pid) if worker_pid else None
                start = time.perf_counter()
                results = await asyncio.gather(
                    *[read_stream(stubs[i % len(stubs)], sluice_request(i, max_tokens)) for i in range(c)]
                )
                level = LevelResult(c, time.perf_counter() - start, list(results))
                by_level[c] = level.tokens_per_s
                print_level(f"sluice round {round_}", level)
                if before is not None:
                    tokens = sum(r.tokens for r in level.results)
                    print(f"  {cpu_line(before, snapshot(before.root), tokens)}", flush=True)
    finally:
        for channel in channels:
            await channel.close()
    return rounds[0], rounds[-1]


# ------------------------------------------------------------------ transformers generate_batch


def generate_batch_levels(
    model_dir: Path, device: str, dtype: str, levels: list[int], max_tokens: int
) -> dict[int, float]:
    """transformers' continuous batching in this process, one call per level; tok/s per level."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, ContinuousBatchingConfig, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
    inputs = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt(i)}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        for i in range(max(levels))
    ]
    config = GenerationConfig(
        max_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=tokenizer.pad_token_id
    )

    # On CUDA the engine sizes its paged cache from free GPU memory, as it would serving. On the
    # CPU that rule takes a slice of host RAM so large that allocating it dwarfs the smoke run.
    cache = (
        None if device.startswith("cuda") else ContinuousBatchingConfig(num_blocks=64, max_batch_tokens=1024)
    )

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    found: dict[int, float] = {}
    try:
        model.generate_batch(
            inputs=inputs[:4], generation_config=config, continuous_batching_config=cache
        )  # warm-up
        for c in levels:
            sync()
            start = time.perf_counter()
            outputs = model.generate_batch(
                inputs=inputs[:c], generation_config=config, continuous_batching_config=cache
            )
            sync()
            wall = time.perf_counter() - start
            tokens = sum(len(o.generated_tokens) for o in outputs.values())
            found[c] = tokens / wall
            print(
                f"generate_batch c={c:<4} {found[c]:9.1f} tok/s  ({tokens} tokens in {wall:6.2f} s)",
                flush=True,
            )
    finally:
        del model
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return found


# ------------------------------------------------------------------ transformers serve


def serve_missing() -> str | None:
    """Why ``transformers serve`` cannot run here, or None."""
    missing = [name for name in ("fastapi", "uvicorn") if importlib.util.find_spec(name) is None]
    return f"needs transformers[serving] ({', '.join(missing)} missing)" if missing else None


async def serve_levels(base: str, model: str, levels: list[int], max_tokens: int) -> dict[int, float]:
    url = f"{base}/v1/chat/completions"

    def body(i: int) -> dict[str, object]:
        return {
            "model": model,
            "stream": True,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "messages": [{"role": "user", "content": prompt(i)}],
            "stream_options": {"include_usage": True},
        }

    found: dict[int, float] = {}
    async with httpx.AsyncClient(timeout=1800) as client:
        await asyncio.gather(*[read_sse_stream(client, url, body(i)) for i in range(4)])  # warm-up
        for c in levels:
            start = time.perf_counter()
            results: list[StreamResult] = list(
                await asyncio.gather(*[read_sse_stream(client, url, body(i)) for i in range(c)])
            )
            level = LevelResult(c, time.perf_counter() - start, results)
            found[c] = level.tokens_per_s
            print_level("serve", level)
    return found


# ------------------------------------------------------------------ report


def print_level(name: str, level: LevelResult) -> None:
    tokens = sum(r.tokens for r in level.results)
    print(
        f"{name} c={level.concurrency:<4} {level.tokens_per_s:9.1f} tok/s  "
        f"({tokens} tokens in {level.wall:6.2f} s)"
        f"  ttft p50 {level.ttft(0.5):6.3f} s  gap p50 {level.gap(0.5) * 1000:6.1f} ms",
        flush=True,
    )


@dataclass
class Table:
    """Tok/s per level for each server; a level a server did not run is absent from its dict."""

    shape: str
    first: dict[int, float] = field(default_factory=dict)  # Sluice, first round after start
    sluice: dict[int, float] = field(default_factory=dict)  # Sluice, measured (second) round
    generate_batch: dict[int, float] = field(default_factory=dict)
    serve: dict[int, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def format_table(table: Table, levels: list[int]) -> str:
    """The issue-12 table as markdown: one row per level, "-" where a server did not run.

    Sluice's cell is the measured round (with ms per token at one stream); the first-round cell
    adds its ratio to the measured round, and the last column is Sluice / generate_batch.
    """

    def cell(values: dict[int, float], c: int) -> str:
        return f"{values[c]:,.1f}" if c in values else "-"

    lines = [
        "| model shape | streams | Sluice tok/s | Sluice first round | transformers `generate_batch` "
        "| `transformers serve --continuous-batching` | Sluice / generate_batch |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for c in levels:
        ours = cell(table.sluice, c)
        if c == 1 and table.sluice.get(1):
            ours += f" ({1000 / table.sluice[1]:.1f} ms/token)"
        first = cell(table.first, c)
        if c in table.first and table.sluice.get(c):
            first += f" ({table.first[c] / table.sluice[c]:.2f}x)"
        ratio = (
            f"{table.sluice[c] / table.generate_batch[c]:.2f}x"
            if table.sluice.get(c) and table.generate_batch.get(c)
            else "-"
        )
        lines.append(
            f"| {table.shape} | {c} | {ours} | {first} | {cell(table.generate_batch, c)} "
            f"| {cell(table.serve, c)} | {ratio} |"
        )
    return "\n".join(lines + [f"\n{note}" for note in table.notes])


def parse_levels(text: str) -> list[int]:
    """``"1,16,64"`` -> [1, 16, 64]; every level a positive integer."""
    try:
        levels = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--levels must be comma-separated integers, got {text!r}") from None
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"--levels must be positive integers, got {text!r}")
    return levels


def parse_skip(text: str) -> set[str]:
    names = {part.strip() for part in text.split(",") if part.strip()}
    unknown = names - set(PEERS)
    if unknown:
        raise argparse.ArgumentTypeError(f"--skip takes {', '.join(PEERS)}; got {', '.join(sorted(unknown))}")
    return names


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        import torch

        props = torch.cuda.get_device_properties(torch.device(device))
        return f"{props.name} ({props.total_memory / 2**30:.0f} GiB)"
    import platform

    return f"CPU ({platform.processor() or platform.machine()})"


def sluice_worker_flags(
    model_dir: Path, device: str, dtype: str, levels: list[int], extra: str, max_running: int | None = None
) -> list[str]:
    """The worker's flags: room for the largest level at once (``--max-running``), INFO logs (the
    line saying the CUDA graphs were captured), then ``extra``, whose flags win."""
    defaults = ["--max-running", str(max_running or max(levels)), "--log-level", "INFO"]
    fixed = ["--model", str(model_dir), "--device", device, "--dtype", dtype,
             "--max-queue", str(max(4096, max(levels)))]  # fmt: skip
    return merged_flags(defaults, fixed + shlex.split(extra))


def tokenizer_dir(given: Path | None) -> Path:
    """``--tokenizer`` when given (no default-model package needed), else the default model's."""
    return given if given is not None else default_tokenizer_dir(DEFAULT_CACHE_DIR)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--shape", choices=sorted(SHAPES), default="1.7b", help="random-weight model to build"
    )
    source.add_argument("--model", type=Path, help="a Hugging Face model folder instead of --shape")
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    parser.add_argument("--dtype", default="auto", help="auto (bfloat16 on CUDA, float32 on the CPU), ...")
    parser.add_argument("--levels", type=parse_levels, default=[1, 16, 64, 256], help="concurrent streams")
    parser.add_argument("--max-tokens", type=int, default=128, help="greedy tokens per stream")
    parser.add_argument("--skip", type=parse_skip, default=set(), help=f"comma list of: {', '.join(PEERS)}")
    parser.add_argument(
        "--model-cache",
        type=Path,
        default=DEFAULT_CACHE_DIR / "bench-models",
        help="where built --shape models are kept",
    )
    parser.add_argument("--tokenizer", type=Path, help="tokenizer folder (default: the default model's)")
    parser.add_argument("--rounds", type=int, default=2, help="Sluice rounds (first and last printed)")
    parser.add_argument(
        "--max-running", type=int, help="the worker's --max-running (default: the largest level)"
    )
    parser.add_argument("--worker-args", default="", help='more worker flags, e.g. "--max-running 512"')
    parser.add_argument(
        "--connections", type=int, default=1, help="Sluice client connections, streams round-robin over them"
    )
    args = parser.parse_args()
    dtype = resolved_dtype(args.device, args.dtype)
    levels: list[int] = args.levels

    if args.model:
        model_dir, shape = args.model.resolve(), args.model.name
    else:
        tokenizer = tokenizer_dir(args.tokenizer)
        model_dir = build_model(
            args.shape, args.model_cache / f"{args.shape}-{dtype}", tokenizer, args.device, dtype
        )
        shape = SHAPE_NAMES[args.shape]
    print(f"device: {device_name(args.device)}, model: {shape} ({model_dir}), {dtype}, "
          f"{args.max_tokens} greedy tokens per stream, levels {levels}", flush=True)  # fmt: skip
    table = Table(shape)

    if "sluice" not in args.skip:
        flags = sluice_worker_flags(model_dir, args.device, dtype, levels, args.worker_args, args.max_running)
        print("worker flags:", shlex.join(flags), flush=True)
        proc, address = start_worker(None, flags, defaults=())
        try:
            table.first, table.sluice = asyncio.run(
                sluice_rounds(address, levels, args.max_tokens, args.rounds, proc.pid, args.connections)
            )
        finally:
            stop(proc)

    if "generate_batch" not in args.skip:
        try:
            table.generate_batch = generate_batch_levels(
                model_dir, args.device, dtype, levels, args.max_tokens
            )
        except Exception as error:  # the peer's failure is reported, never the end of the run
            table.notes.append(f"generate_batch failed: {error!r}"[:300])

    if "serve" not in args.skip:
        why = serve_missing()
        if why is None:
            try:
                peer, base = start_peer(str(model_dir), args.device, dtype)
            except SystemExit as error:
                why = str(error)
            else:
                try:
                    table.serve = asyncio.run(serve_levels(base, str(model_dir), levels, args.max_tokens))
                finally:
                    stop(peer)
        if why:
            table.notes.append(f"transformers serve skipped: {why}")

    print()
    print(format_table(table, levels))


if __name__ == "__main__":
    main()
