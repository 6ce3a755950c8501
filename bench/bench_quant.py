"""Weight-only quantization kernels on the CPU: candidates against the oneDNN float32 packed path.

Usage::

    python bench/bench_quant.py                    # rows 1,16, 7 rounds, layers and decode steps
    python bench/bench_quant.py --rows 1 --rounds 5 --skip-steps

Part 1, kernels: every linear layer of the default model (211, in model order)
on a batch of R rows, once per candidate, alternating candidates within each
round; prints the median ms per pass (the matrix products of one decode step)
for each layer shape and for the whole pass, and each candidate's ratio to
float32. Candidates (each built from the same float32 weights the worker serves
today, dequantized from the GGUF file):

- ``float32-onednn``: the worker's packed float32 layers (worker/model/packed_linear.py);
- ``int8-aten``: ``aten._weight_int8pack_mm`` (int8, one scale per row, bfloat16 activations);
- ``int4-aten``: ``aten._weight_int4pack_mm_for_cpu`` (4-bit groups of 32, bfloat16 activations);
- ``int4-worker``: the worker's int4 layer: ``int4-aten`` below ``BATCH_ROWS`` (4) rows, its
  float16 batch copy (``fp16-fbgemm`` on the int4 weight) from there on;
- ``fp16-fbgemm``: ``quantized.linear_dynamic_fp16`` (float16 weights packed by fbgemm);
- ``w8a8-fbgemm``: ``quantized.linear_dynamic`` (int8 weights and int8 activations, dynamic);
- ``int4-kleidiai``: ``aten._dyn_quant_matmul_4bit`` (where this build has it).

Part 2, decode steps: the whole model in the worker's runner (the default
model loaded with ``--quantization none``, ``int8`` and ``int4``), R rows of a
chat prompt prefilled, then one decode step per model per round, alternating;
the median ms per step.

Figures and the choice they led to: docs/quantization.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

warnings.filterwarnings("ignore", message=".*quantize_per_channel.*")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from worker.model.loader import load_model  # noqa: E402
from worker.model.packed_linear import PackedLinear  # noqa: E402
from worker.model.runner import ModelRunner  # noqa: E402
from worker.model.step_inputs import Work  # noqa: E402
from worker.quant.layers import Int4Linear, Int8Linear  # noqa: E402

Kernel = Callable[[torch.Tensor], torch.Tensor]


def fbgemm_fp16(weight: torch.Tensor) -> Kernel:
    packed = torch.ops.quantized.linear_prepack_fp16(weight, None)
    return lambda x: torch.ops.quantized.linear_dynamic_fp16(x, packed)


def fbgemm_w8a8(weight: torch.Tensor) -> Kernel:
    scale = (weight.abs().amax(dim=1) / 127).clamp(min=1e-12).double()
    zeros = torch.zeros(weight.shape[0], dtype=torch.long)
    qweight = torch.quantize_per_channel(weight, scale, zeros, 0, torch.qint8)
    packed = torch.ops.quantized.linear_prepack(qweight, None)
    return lambda x: torch.ops.quantized.linear_dynamic(x, packed, True)


def kleidiai_int4(weight: torch.Tensor) -> Kernel:
    out_features, in_features = weight.shape
    group = 32
    groups = weight.reshape(out_features, -1, group)
    scale = (groups.abs().amax(dim=-1) / 7).clamp(min=1e-12)
    q = (torch.round(groups / scale[..., None]).clamp(-8, 7) + 8).to(torch.uint8).reshape(out_features, -1)
    packed = torch.ops.aten._dyn_quant_pack_4bit_weight(q, scale, None, group, in_features, out_features)
    return lambda x: torch.ops.aten._dyn_quant_matmul_4bit(x, packed, group, in_features, out_features)


_reported: set[str] = set()


def candidates(weight: torch.Tensor, rows: int) -> dict[str, Kernel]:
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight.data = weight
    built: dict[str, Kernel] = {
        "float32-onednn": PackedLinear(linear, rows),
        "int8-aten": Int8Linear.from_float(weight, batch_copy=False),
        "int4-aten": Int4Linear.from_float(weight, batch_copy=False),
        "int4-worker": Int4Linear.from_float(weight),  # int4 below BATCH_ROWS rows, fp16 copy from it on
    }
    for name, make in (
        ("fp16-fbgemm", fbgemm_fp16),
        ("w8a8-fbgemm", fbgemm_w8a8),
        ("int4-kleidiai", kleidiai_int4),
    ):
        try:
            kernel = make(weight)
            kernel(torch.randn(rows, weight.shape[1]))
            built[name] = kernel
        except (RuntimeError, AttributeError) as exc:
            if name not in _reported:
                _reported.add(name)
                print(f"  {name} unavailable: {str(exc).splitlines()[0][:100]}")
    return built


def timed(kernels: list[Kernel], inputs: list[torch.Tensor]) -> float:
    start = time.perf_counter()
    with torch.inference_mode():
        for kernel, x in zip(kernels, inputs, strict=True):
            kernel(x)
    return (time.perf_counter() - start) * 1000


def kernel_part(weights: list[tuple[str, torch.Tensor]], rows: int, rounds: int) -> None:
    per_layer = [candidates(w, rows) for _, w in weights]
    names = [n for n in per_layer[0] if all(n in c for c in per_layer)]
    inputs = [torch.randn(rows, w.shape[1]) for _, w in weights]
    shapes = sorted({tuple(w.shape) for _, w in weights}, key=lambda s: -s[0] * s[1])
    times: dict[tuple[str, str], list[float]] = {}
    for round_ in range(rounds + 1):  # round 0 warms up
        for name in names:
            total = timed([c[name] for c in per_layer], inputs)
            if round_:
                times.setdefault((name, "all"), []).append(total)
            for shape in shapes:
                picked = [i for i, (_, w) in enumerate(weights) if tuple(w.shape) == shape]
                ms = timed([per_layer[i][name] for i in picked], [inputs[i] for i in picked])
                if round_:
                    times.setdefault((name, str(shape)), []).append(ms / len(picked))
    base = statistics.median(times[("float32-onednn", "all")])
    print(f"\nrows {rows}: all {len(weights)} linear layers, median ms per pass ({rounds} rounds)")
    for name in names:
        ms = statistics.median(times[(name, "all")])
        print(f"  {name:15} {ms:7.1f} ms  {base / ms:5.2f}x float32")
    print(f"rows {rows}: per layer of each shape [out, in] (count), median ms per layer")
    header = "  ".join(f"{n:>14}" for n in names)
    print(f"  {'shape':>14} {'n':>3}  {header}")
    for shape in shapes:
        count = sum(1 for _, w in weights if tuple(w.shape) == shape)
        cells = "  ".join(f"{statistics.median(times[(n, str(shape))]):14.3f}" for n in names)
        print(f"  {list(shape)!s:>14} {count:>3}  {cells}")


PROMPT = [{"role": "user", "content": "Write a long story about a dragon who learns to cook."}]


def step_part(rows_list: list[int], rounds: int, schemes: list[str], cache_dir: str | None) -> None:
    cache = Path(cache_dir) if cache_dir else None
    models = {
        s: load_model(None, device="cpu", dtype="float32", quantization=s, cache_dir=cache) for s in schemes
    }
    tokenizer = next(iter(models.values())).tokenizer
    text = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False)
    prompt = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    for rows in rows_list:
        size = 16
        per_row = -(-(len(prompt) + rounds + 2) // size)
        tables = [list(range(i * per_row, (i + 1) * per_row)) for i in range(rows)]
        runners = {s: ModelRunner(m, num_blocks=rows * per_row, block_size=size) for s, m in models.items()}
        for runner in runners.values():
            runner.execute([Work(prompt, 0, table, True) for table in tables])
        times: dict[str, list[float]] = {s: [] for s in schemes}
        for round_ in range(rounds + 1):
            for scheme, runner in runners.items():
                start = time.perf_counter()
                runner.execute([Work([42], len(prompt) + round_, table, True) for table in tables])
                if round_:
                    times[scheme].append((time.perf_counter() - start) * 1000)
        base = statistics.median(times["none"]) if "none" in times else None
        print(f"\nrows {rows}: one decode step of the whole model (runner), median of {rounds}")
        for scheme, values in times.items():
            ms = statistics.median(values)
            ratio = f"  {base / ms:5.2f}x float32" if base else ""
            print(
                f"  {scheme:6} {ms:7.1f} ms  (min {min(values):.1f}, max {max(values):.1f}){ratio}",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", default="1,4,16")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    parser.add_argument("--skip-kernels", action="store_true")
    parser.add_argument("--skip-steps", action="store_true")
    parser.add_argument("--schemes", default="none,int8,int4", help="for the decode steps")
    parser.add_argument("--cache-dir", help="the worker's converted-model cache")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows_list = [int(r) for r in args.rows.split(",")]
    print(
        f"{torch.get_num_threads()} threads, torch {torch.__version__}, "
        f"CPU capability {torch.backends.cpu.get_cpu_capability()}"
    )
    if not args.skip_kernels:
        cache = Path(args.cache_dir) if args.cache_dir else None
        model = load_model(
            None, device="cpu", dtype="float32", cpu_linear="torch", quantization="none", cache_dir=cache
        )
        weights = [
            (name, m.weight.detach().clone())
            for name, m in model.model.named_modules()
            if isinstance(m, torch.nn.Linear)
        ]
        del model
        for rows in rows_list:
            kernel_part(weights, rows, args.rounds)
    if not args.skip_steps:
        step_part(rows_list, args.rounds, args.schemes.split(","), args.cache_dir)


if __name__ == "__main__":
    main()
