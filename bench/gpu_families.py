"""The GPU check of the paths added after the dense fast path: hybrid and Gemma 4 models, quantized KV
caches and LoRA adapters, each served by a real worker and compared with transformers (and peft).

Usage, on the GPU machine (``make gpu-check`` runs it as one step)::

    python3 bench/gpu_families.py --dense /tmp/sluice-models/1.7b-bfloat16
    python3 bench/gpu_families.py --device cpu --dtype float32 --scale tiny --cases qwen3_5_text

Cases (``--cases``, in this order):

- ``qwen3_5_text``, ``granitemoehybrid``, ``gemma4_text``: a random-weight model of the family
  (``--scale mid``: hidden 1024, 12 layers, the default model's vocabulary) served without
  ``--require-cuda-graphs``: greedy tokens against ``generate`` (bf16: a first difference among
  generate's top 5 passes, as in gpu_check), one stream's and 64 streams' tok/s, and what the
  fast-path metric says (kernel, graphs, mixer kernels);
- ``kv-fp8``, ``kv-int8``: the ``--dense`` model with ``--kv-cache-dtype``, graphs required: greedy
  against ``generate`` with the float cache's reference, tok/s at 64 and 256 streams, the pool's tokens;
- ``lora``: the ``--dense`` model with 8 random rank-8 PEFT adapters: adapter 0's greedy tokens
  against peft's merged model, 64 streams' tok/s on the base alone and spread over 1, 4 and 8
  adapters, and whether decode steps with adapter rows replayed graphs (the adapter-replay counter;
  failed unless every decode-only step replayed and some had adapter rows);
- ``quant-int4``, ``quant-fp8``: the ``--dense`` model with ``--quantization``, graphs required (the
  worker's log names the layers' kernels): how many greedy tokens agree with the float model's
  ``generate`` before the first difference (reported, not failed: the weights differ), and tok/s at
  1, 64 and 256 streams.

Prints one line per case and a closing table; exit status 1 when a case failed.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "bench")]

from gpu_check import (  # noqa: E402
    Reference,
    Step,
    checked,
    fast_path_problems,
    greedy_stream,
    parse_metrics,
    prompt_ids,
    reference_greedy,
    serving,
    summary,
)

FAMILIES = ("qwen3_5_text", "granitemoehybrid", "gemma4_text")
CASES = (*FAMILIES, "kv-fp8", "kv-int8", "lora", "quant-int4", "quant-fp8")
LORA_COUNTS = (1, 4, 8)

# --scale mid: the tiny families' layer patterns repeated to 12 layers at a small real model's width.
MID: dict[str, Any] = {
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "max_position_embeddings": 8192,
    "initializer_range": 0.02,
}
MID_FAMILY: dict[str, dict[str, Any]] = {
    "qwen3_5_text": {
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_num_key_heads": 8,
        "linear_num_value_heads": 16,
    },
    "granitemoehybrid": {
        "mamba_n_heads": 32,
        "mamba_d_head": 64,
        "mamba_d_state": 128,
        "mamba_chunk_size": 256,
        "moe_intermediate_size": 1024,
    },
    "gemma4_text": {
        "head_dim": 128,
        "global_head_dim": 256,
        "sliding_window": 512,
        "hidden_size_per_layer_input": 64,
        "num_kv_shared_layers": 4,
    },
}


def family_config(family: str, vocab: int, scale: str) -> Any:
    """``family``'s tiny config (tests/tiny_families.py) on ``vocab`` tokens; ``mid``: widened and its
    layer pattern repeated to 12 layers."""
    from tests.tiny_families import FAMILIES as DENSE
    from tests.tiny_families import HYBRID_FAMILIES, tiny_config

    changes: dict[str, Any] = {"vocab_size": vocab}
    if scale == "mid":
        _, overrides = DENSE[family] if family in DENSE else HYBRID_FAMILIES[family]
        key = "layers_block_type" if "layers_block_type" in overrides else "layer_types"
        pattern = list(overrides[key])
        repeat = 12 // len(pattern) if 12 % len(pattern) == 0 else 3
        changes |= MID | MID_FAMILY.get(family, {})
        changes |= {key: pattern * repeat, "num_hidden_layers": len(pattern) * repeat}
    if family == "gemma4_text":
        changes["vocab_size_per_layer_input"] = vocab
    return tiny_config(family, **changes)


def build_family(family: str, folder: Path, tokenizer_dir: Path, device: str, dtype: str, scale: str) -> Path:
    """A random-weight ``family`` model with ``tokenizer_dir``'s tokenizer, saved in ``folder`` (once)."""
    if (folder / "config.json").is_file():
        return folder
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = family_config(family, len(tokenizer), scale)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(config, name, getattr(tokenizer, name))
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    from bench_gpu import save_with_tokenizer

    millions = save_with_tokenizer(model, folder, tokenizer_dir)
    print(f"built {family} ({scale}): {millions:.0f}M parameters -> {folder}", flush=True)
    del model
    free_memory()
    return folder


def free_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


async def streams_rate(stub: Any, count: int, tokens: int, model: str = "", spread: int = 0) -> float:
    """tok/s of ``count`` concurrent greedy streams of ``tokens`` tokens each (``spread`` N: stream i
    under adapter ``lora{i mod N}``; else ``model``)."""
    from bench_gpu import sluice_request
    from bench_worker import read_stream

    requests = []
    for i in range(count):
        request = sluice_request(i, tokens)
        request.model = f"lora{i % spread}" if spread else model
        requests.append(request)
    started = time.perf_counter()
    results = await asyncio.gather(*[read_stream(stub, r) for r in requests])
    return sum(r.tokens for r in results) / (time.perf_counter() - started)


def fast_path(text: str) -> str:
    """The fast-path metric's parts that are on or off, in a few words."""
    samples = parse_metrics(text)
    parts = {k.split('"')[1]: v for k, v in samples.items() if k.startswith("sluice_worker_fast_path{")}
    return " ".join(f"{part}={'on' if on else 'off'}" for part, on in sorted(parts.items()))


def pool_size(text: str) -> str:
    """The KV pool's blocks and bytes, as /metrics gives them (the capacity a cache dtype buys)."""
    samples = parse_metrics(text)
    blocks, size = (
        samples.get("sluice_worker_kv_cache_blocks", 0),
        samples.get("sluice_worker_kv_cache_bytes", 0),
    )
    return f"KV pool {blocks:.0f} blocks in {size / 2**30:.2f} GiB"


@functools.cache
def dense_reference(dense: Path, tokens: int, device: str, dtype: str) -> Reference:
    """The dense model's ``generate`` from the bench prompt (the kv-* and quant-* cases share it)."""
    return reference_greedy(dense, prompt_ids(dense), tokens, device, dtype)


def family_case(family: str, args: argparse.Namespace) -> Step:
    folder = build_family(family, args.models / f"{family}-{args.scale}-{args.dtype}", args.tokenizer,
                          args.device, args.dtype, args.scale)  # fmt: skip
    ids = prompt_ids(folder)
    reference = reference_greedy(folder, ids, args.tokens, args.device, args.dtype)

    async def talk(stub: Any) -> tuple[list[int], float, float]:
        got, _ = await greedy_stream(stub, ids, args.tokens)
        one = await streams_rate(stub, 1, 128)
        many = await streams_rate(stub, 64, 128)
        return got, one, many

    (got, one, many), text = serving(folder, args.device, args.dtype, ["--max-running", "64"], talk, False)
    step = checked(f"{family}: greedy vs generate, {args.dtype}", got, reference, args.dtype)
    step.detail += (
        f"; 1 stream {one:.0f} tok/s, 64 streams {many:.0f} tok/s; {fast_path(text)}; {pool_size(text)}"
    )
    return step


def kv_case(kind: str, args: argparse.Namespace) -> Step:
    ids = prompt_ids(args.dense)
    reference = dense_reference(args.dense, args.tokens, args.device, args.dtype)

    async def talk(stub: Any) -> tuple[list[int], float, float]:
        got, _ = await greedy_stream(stub, ids, args.tokens)
        return got, await streams_rate(stub, 64, 128), await streams_rate(stub, 256, 128)

    (got, at64, at256), text = serving(args.dense, args.device, args.dtype, ["--kv-cache-dtype", kind], talk)
    step = checked(f"--kv-cache-dtype {kind}: greedy vs generate (float cache)", got, reference, args.dtype)
    problems = fast_path_problems(parse_metrics(text)) if args.device.startswith("cuda") else []
    step.ok = step.ok and not problems
    step.detail += f"; 64 streams {at64:.0f} tok/s, 256 streams {at256:.0f} tok/s; {pool_size(text)}"
    step.detail += "; " + ("; ".join(problems) or "graphs replayed every decode-only step")
    return step


def quant_case(scheme: str, args: argparse.Namespace) -> Step:
    ids = prompt_ids(args.dense)
    reference = dense_reference(args.dense, args.tokens, args.device, args.dtype)[0]

    async def talk(stub: Any) -> tuple[list[int], list[float]]:
        got, _ = await greedy_stream(stub, ids, args.tokens)
        return got, [await streams_rate(stub, count, 128) for count in (1, 64, 256)]

    (got, rates), text = serving(args.dense, args.device, args.dtype, ["--quantization", scheme], talk)
    agree = next((i for i, (a, b) in enumerate(zip(got, reference, strict=False)) if a != b), len(got))
    problems = fast_path_problems(parse_metrics(text)) if args.device.startswith("cuda") else []
    detail = f"{agree} of {len(got)} greedy tokens as the float model's before the first difference; "
    detail += f"1 / 64 / 256 streams {rates[0]:.0f} / {rates[1]:.0f} / {rates[2]:.0f} tok/s; "
    detail += "; ".join(problems) or "graphs replayed every decode-only step"
    return Step(f"--quantization {scheme}: served", not problems, detail)


def build_adapters(base: Path, folder: Path, count: int, device: str, dtype: str) -> list[Path]:
    """``count`` random rank-8 PEFT adapters of ``base`` over every projection: peft writes the first
    (its config and tensor names); the others are the same file with other random values."""
    import torch
    from bench_worker import LORA_RANK
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from tests.lora_adapters import ALL_TARGETS

    model = AutoModelForCausalLM.from_pretrained(base, dtype=getattr(torch, dtype)).to(device)
    config = LoraConfig(r=LORA_RANK, lora_alpha=16, target_modules=list(ALL_TARGETS), init_lora_weights=False)
    get_peft_model(model, config).save_pretrained(str(folder / "0"))
    del model
    free_memory()
    first = load_file(str(folder / "0" / "adapter_model.safetensors"))
    folders = [folder / "0"]
    for i in range(1, count):
        generator = torch.Generator().manual_seed(i)
        tensors = {
            k: (torch.randn(v.shape, generator=generator) * 0.02).to(v.dtype) for k, v in first.items()
        }
        folders.append(folder / str(i))
        folders[-1].mkdir(parents=True)
        shutil.copy(folder / "0" / "adapter_config.json", folders[-1] / "adapter_config.json")
        save_file(tensors, str(folders[-1] / "adapter_model.safetensors"))
    return folders


def lora_case(args: argparse.Namespace) -> Step:
    from bench_worker import LORA_RANK

    folder = args.models / "adapters"
    shutil.rmtree(folder, ignore_errors=True)
    adapters = build_adapters(args.dense, folder, max(LORA_COUNTS), args.device, args.dtype)
    ids = prompt_ids(args.dense)
    reference = reference_greedy(args.dense, ids, args.tokens, args.device, args.dtype, adapters[0])
    modules = " ".join(f"lora{i}={path}" for i, path in enumerate(adapters))
    flags = ["--enable-lora", "--max-loras", str(len(adapters)), "--max-lora-rank", str(LORA_RANK),
             "--lora-modules", modules]  # fmt: skip

    async def talk(stub: Any) -> tuple[list[int], dict[int, float]]:
        got, _ = await greedy_stream(stub, ids, args.tokens, model="lora0")
        rates = {0: await streams_rate(stub, 64, 128)}
        for n in LORA_COUNTS:
            rates[n] = await streams_rate(stub, 64, 128, spread=n)
        return got, rates

    (got, rates), text = serving(args.dense, args.device, args.dtype, flags, talk)
    step = checked("LoRA adapter vs peft merged, greedy", got, reference, args.dtype)
    costs = ", ".join(f"{n} adapters {rates[n]:.0f} ({rates[n] / rates[0]:.2f}x)" for n in LORA_COUNTS)
    step.detail += f"; 64 streams: base {rates[0]:.0f} tok/s, {costs}"
    if args.device.startswith("cuda"):
        samples = parse_metrics(text)
        problems = fast_path_problems(samples)
        adapter_replays = samples.get("sluice_worker_decode_graph_lora_replays_total", 0.0)
        if not adapter_replays:
            problems.append("no decode step with adapter rows replayed a graph")
        step.ok = step.ok and not problems
        step.detail += f"; {adapter_replays:.0f} replays with adapter rows of "
        step.detail += f"{samples.get('sluice_worker_decode_graph_replays_total', 0.0):.0f}; "
        step.detail += "; ".join(problems) or "graphs replayed every decode-only step, adapter ones too"
    return step


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma list of: {', '.join(CASES)}")
    parser.add_argument("--dense", type=Path, help="the dense model folder (kv-* and lora cases)")
    parser.add_argument("--tokenizer", type=Path, default=REPO / ".gpu" / "tok")
    parser.add_argument("--models", type=Path, default=Path("/tmp/sluice-models"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--scale", default="mid", choices=("mid", "tiny"))
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--summary", type=Path, help="also write the table here (after every case)")
    args = parser.parse_args(argv)
    args.cases = [c for c in args.cases.split(",") if c]
    unknown = sorted(set(args.cases) - set(CASES))
    if unknown:
        parser.error(f"unknown cases: {', '.join(unknown)}")
    if args.dense is None and any(c not in FAMILIES for c in args.cases):
        parser.error("the kv-* and lora cases need --dense")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    steps: list[Step] = []
    for case in args.cases:
        print(f"\n== {case}", flush=True)
        started = time.monotonic()
        try:
            if case in FAMILIES:
                step = family_case(case, args)
            elif case.startswith("kv-"):
                step = kv_case(case.removeprefix("kv-"), args)
            elif case.startswith("quant-"):
                step = quant_case(case.removeprefix("quant-"), args)
            else:
                step = lora_case(args)
        except (Exception, SystemExit) as error:  # one case's failure (a worker that exits too)
            import traceback

            traceback.print_exc()
            step = Step(case, False, repr(error)[:300])
        free_memory()
        step.detail += f" ({time.monotonic() - started:.0f} s)"
        print(f"{case}: {'ok' if step.ok else 'FAILED'}: {step.detail}", flush=True)
        steps.append(step)
        if args.summary:
            args.summary.write_text(summary(steps)[0] + "\n")
    table, status = summary(steps)
    print(table, flush=True)
    print(json.dumps({s.name: s.detail for s in steps}))
    return status


if __name__ == "__main__":
    sys.exit(main())
