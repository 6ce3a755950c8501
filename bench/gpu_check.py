"""One command that proves the GPU path on a device (`make gpu-check`, under 8 minutes on an H100).

Usage, on the GPU machine from this checkout with .gpu/ (made here by `make gpu-wheels`)::

    python3 bench/gpu_check.py                 # everything; exit status 1 on any functional failure
    python3 bench/gpu_check.py --skip-bench    # the functional checks only

Steps: install .gpu/wheels into a private folder; print versions; run every CUDA test (pytest,
none may skip); serve a random-weight 1.7B model with --require-cuda-graphs and check greedy bf16
output against transformers' ``generate`` for 32 tokens (a divergence at a near-tie of the logits,
by margin, is reported, not failed); check from /metrics that the kernel and graphs are on and that
every decode-only step replayed a graph; then run bench/bench_gpu.py and print its table.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SITE = Path("/tmp/sluice-gpu-site")
CUDA_TESTS = ("tests/unit/worker/test_triton_decode.py", "tests/unit/worker/test_cuda_path.py")
NEAR_TIE = 0.1  # logit margin (top-1 minus top-2) under which bf16 rounding may flip a greedy pick
_SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$")


@dataclass
class Step:
    name: str
    ok: bool
    detail: str = ""


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> ``{"name{labels}": value}`` (labels as written, the model label dropped)."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line.strip())
        if not match or line.startswith("#"):
            continue
        labels = re.sub(r'model="[^"]*",?', "", match.group(2) or "").replace("{}", "")
        found[match.group(1) + labels] = float(match.group(3))
    return found


def fast_path_problems(samples: dict[str, float]) -> list[str]:
    """What /metrics says is wrong with the fast path (empty: kernel and graphs on, every
    decode-only step replayed)."""
    problems = [
        f"{part} is off"
        for part in ("kernel", "graphs")
        if samples.get(f'sluice_worker_fast_path{{part="{part}"}}') != 1.0
    ]
    steps = samples.get("sluice_worker_decode_only_steps_total", 0.0)
    replays = samples.get("sluice_worker_decode_graph_replays_total", 0.0)
    if steps == 0:
        problems.append("no decode-only step ran")
    elif replays != steps:
        problems.append(f"{replays:.0f} graph replays for {steps:.0f} decode-only steps")
    return problems


def compare_greedy(ours: list[int], reference: list[int], margins: list[float]) -> Step:
    """Ours against ``generate``'s tokens; ``margins[i]``: the reference's top-1 minus top-2 logit
    at token ``i``. A first difference at a margin under :data:`NEAR_TIE` is a near-tie."""
    for i, (a, b) in enumerate(zip(ours, reference, strict=False)):
        if a != b:
            tie = margins[i] < NEAR_TIE
            what = "near-tie" if tie else "diverged"
            return Step("greedy vs generate", tie, f"{what} at token {i} (margin {margins[i]:.3f})")
    if len(ours) != len(reference):
        return Step("greedy vs generate", False, f"{len(ours)} tokens against {len(reference)}")
    return Step("greedy vs generate", True, f"{len(ours)} tokens equal")


def summary(steps: list[Step]) -> tuple[str, int]:
    """The closing table and the exit status (1 when a step failed)."""
    lines = ["", "| check | result | detail |", "| --- | --- | --- |"]
    lines += [f"| {s.name} | {'ok' if s.ok else 'FAILED'} | {s.detail} |" for s in steps]
    return "\n".join(lines), 0 if all(s.ok for s in steps) else 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gpu-dir", type=Path, default=REPO / ".gpu", help="what `make gpu-wheels` made")
    parser.add_argument("--skip-bench", action="store_true", help="the functional checks only")
    parser.add_argument("--levels", default="1,16,64,256")
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens compared with generate")
    return parser.parse_args(argv)


def run(name: str, command: list[str], env: dict[str, str], timeout: float) -> Step:
    print(f"\n== {name}: {' '.join(command)}", flush=True)
    started = time.monotonic()
    try:
        done = subprocess.run(command, cwd=REPO, env=env, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return Step(name, False, f"timed out after {timeout:.0f} s")
    return Step(name, done.returncode == 0, f"exit {done.returncode}, {time.monotonic() - started:.0f} s")


def greedy_and_metrics(model_dir: Path, tokens: int, env: dict[str, str]) -> list[Step]:
    """Serves ``model_dir`` with --require-cuda-graphs; greedy vs generate; the fast path's metrics."""
    sys.path[:0] = [str(SITE), str(REPO), str(REPO / "bench")]
    import torch
    from bench_gpu import prompt, sluice_request
    from bench_worker import read_stream, start_worker, stop
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sluice.v1 import worker_pb2_grpc as pb_grpc

    flags = ["--model", str(model_dir), "--device", "cuda", "--dtype", "bfloat16", "--max-running", "256",
             "--require-cuda-graphs", "--log-level", "INFO", "--metrics-port", "0"]  # fmt: skip
    proc, address = start_worker(None, flags, defaults=())
    steps: list[Step] = []
    try:
        import grpc

        async def ours() -> list[int]:
            async with grpc.aio.insecure_channel(address) as channel:
                request = sluice_request(0, tokens)
                request.sampling.logprobs = 0
                ids: list[int] = []
                async for event in pb_grpc.WorkerStub(channel).Generate(request):
                    if event.WhichOneof("event") == "content":
                        ids += list(event.content.token_ids)
                await asyncio.gather(*[read_stream(pb_grpc.WorkerStub(channel), sluice_request(i, 64))
                                       for i in range(64)])  # fmt: skip
                return ids

        got = asyncio.run(ours())
        port = int(address.rsplit(":", 1)[1]) + 1000
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        problems = fast_path_problems(parse_metrics(text))
        steps.append(
            Step("fast path (metrics)", not problems, "; ".join(problems) or "kernel, graphs, replays")
        )
    finally:
        stop(proc)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    chat = [{"role": "user", "content": prompt(0)}]
    encoded = tokenizer.apply_chat_template(
        chat, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    ids = encoded["input_ids"].cuda()
    out = model.generate(ids, max_new_tokens=tokens, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, eos_token_id=None)  # fmt: skip
    reference = out.sequences[0, ids.shape[1] :].tolist()
    margins = [float(t[0].float().topk(2).values.diff().abs()) for t in out.logits]
    steps.append(compare_greedy(got, reference, margins))
    return steps


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    wheels = sorted(str(p) for p in (args.gpu_dir / "wheels").glob("*.whl"))
    if not wheels:
        print(
            f"no wheels in {args.gpu_dir / 'wheels'}: run `make gpu-wheels` where the network is",
            file=sys.stderr,
        )
        return 1
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--upgrade",
                    "--target", str(SITE), *wheels], check=True)  # fmt: skip
    env = {**os.environ, "PYTHONPATH": f"{SITE}:{REPO}", "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    versions = "import sys,torch,triton,transformers;print(sys.version.split()[0],torch.__version__,"
    versions += "triton.__version__,transformers.__version__,torch.cuda.get_device_name())"
    steps = [run("versions", [sys.executable, "-c", versions], env, 60)]
    cuda_tests = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *CUDA_TESTS]
    steps.append(run("CUDA tests", cuda_tests, {**env, "SLUICE_REQUIRE_CUDA": "1"}, 150))
    model_dir = Path("/tmp/sluice-models/1.7b-bfloat16")
    sys.path[:0] = [str(SITE), str(REPO), str(REPO / "bench")]
    from bench_gpu import build_model

    build_model("1.7b", model_dir, args.gpu_dir / "tok", "cuda", "bfloat16")
    try:
        steps += greedy_and_metrics(model_dir, args.tokens, env)
    except Exception as error:
        steps.append(Step("serve and compare", False, repr(error)[:200]))
    if not args.skip_bench:
        bench = [sys.executable, "bench/bench_gpu.py", "--model", str(model_dir), "--levels", args.levels,
                 "--rounds", "2", "--max-running", "256", "--skip", "serve"]  # fmt: skip
        steps.append(run("bench_gpu", bench, env, 240))
    table, status = summary(steps)
    print(table)
    return status


if __name__ == "__main__":
    sys.exit(main())
