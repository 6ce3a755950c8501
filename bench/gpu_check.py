"""One command that proves the GPU path on a device (`make gpu-check`, under 8 minutes on an H100).

Usage, on the GPU machine from this checkout with .gpu/ (made here by `make gpu-wheels`)::

    python3 bench/gpu_check.py                 # everything; exit status 1 on any functional failure
    python3 bench/gpu_check.py --skip-bench    # the functional checks only
    python3 bench/gpu_check.py --device cpu --shape tiny --skip-bench   # a dry run of the steps here

Steps: install .gpu/wheels into a private folder; print versions; run every CUDA test (pytest,
none may skip); serve a random-weight 1.7B model with --require-cuda-graphs and check greedy bf16
output against transformers' ``generate`` for 32 tokens from the same prompt ids (a divergence at a
near-tie of the logits, by margin, is reported, not failed); check from /metrics that the kernel,
graphs and fused kernels are on and that every decode-only step replayed a graph; serve it with
--speculative ngram (greedy equal to ``generate`` too, one stream's tok/s with and without, the
acceptance); then run bench/bench_gpu.py and print its table, again at 1 stream with
``--no-fused-kernels`` (the forward's RMSNorm, SiLU-mul and rotary as transformers runs them), at
64 and 256 with ``--engine-process``, at 256 with ``--api-server-count 2`` (8 connections), at 1,
64 and 256 with ``--overlap-steps off`` (each draw read between steps) and, when asked
(``--interval-levels``), with ``--stream-interval 4``; then
bench/profile_step.py on the same model (and 8 steps at its most rows under torch's profiler).
A step that fails is reported in the closing table; the later steps still run. The whole check
keeps within ``--budget`` (560 s): a step's timeout is cut to what is left and a step that would get
under 30 s is skipped, so the table (``--summary``: rewritten after every step) is always complete
before a device's 600 s command limit.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

REPO = Path(__file__).resolve().parent.parent
SITE = Path("/tmp/sluice-gpu-site")
KERNEL_SITE = Path("/tmp/sluice-gpu-kernels")  # flash-linear-attention, on the path of the hybrid steps only
# The steps of a whole check, in order (``--steps`` picks some, e.g. to split one check over two calls).
STEPS = ("versions", "tests", "compare", "bench", "families", "extra", "edge", "hybrid", "profile")
# The whole check is about 1,000 s on an H200 (2026-11-29), more than one device command's 600 s, so
# ``--part 1`` and ``--part 2`` split it (steps, gpu_families.py cases, compared dtypes), about 480 s
# each, the first with what decides the bars.
PARTS = {
    "1": (
        "versions,tests,compare,bench,families,edge",
        "qwen3_5_text,granitemoehybrid,gemma4_text,lora",
        "auto",
    ),
    "2": ("versions,families,extra,hybrid,profile", "kv-fp8,kv-int8,quant-int4,quant-fp8", ""),
}
CUDA_TESTS = (
    "tests/unit/worker/test_triton_decode.py",
    "tests/unit/worker/test_cuda_path.py",
    "tests/unit/worker/test_sampler_syncs.py",
    "tests/unit/worker/test_host_copies.py",
    "tests/unit/worker/test_cuda_quant.py",
)
NEAR_TIE = 0.1  # logit margin (top-1 minus top-2) under which bf16 rounding may flip a greedy pick
T = TypeVar("T")
_SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$")


@dataclass
class Step:
    name: str
    ok: bool
    detail: str = ""
    skipped: bool = False


# Seconds kept back from ``--budget`` for the closing table; a step gets no less than MIN_STEP_S.
RESERVE_S = 10.0
MIN_STEP_S = 30.0


@dataclass
class Budget:
    """The check's wall-clock budget (``--budget``): each step's timeout is cut to what is left, and
    a step that would get less than MIN_STEP_S is skipped, so the closing table is always written
    before the device's command limit ends the run."""

    seconds: float
    started: float

    def timeout(self, wanted: float, now: float | None = None) -> float | None:
        """``wanted``, or less where less is left; None: skip the step."""
        left = self.seconds - ((time.monotonic() if now is None else now) - self.started) - RESERVE_S
        return None if left < MIN_STEP_S else min(wanted, left)


def skipped(name: str, budget: Budget) -> Step:
    return Step(name, True, f"skipped: under {MIN_STEP_S:.0f} s left of --budget {budget.seconds:.0f}", True)


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
    """What /metrics says is wrong with the fast path (empty: kernel, graphs and fused kernels on,
    every decode-only step replayed)."""
    problems = [
        f"{part} is off"
        for part in ("kernel", "graphs", "fused")
        if samples.get(f'sluice_worker_fast_path{{part="{part}"}}') != 1.0
    ]
    steps = samples.get("sluice_worker_decode_only_steps_total", 0.0)
    replays = samples.get("sluice_worker_decode_graph_replays_total", 0.0)
    if steps == 0:
        problems.append("no decode-only step ran")
    elif replays != steps:
        problems.append(f"{replays:.0f} graph replays for {steps:.0f} decode-only steps")
    return problems


def compare_greedy(
    ours: list[int],
    reference: list[int],
    margins: list[float],
    near_tie: float = NEAR_TIE,
    alternatives: list[list[int]] | None = None,
    name: str = "greedy vs generate",
) -> Step:
    """Ours against ``generate``'s tokens; ``margins[i]``: the reference's top-1 minus top-2 logit
    at token ``i``. At the first difference: a margin under ``near_tie`` is a near-tie; else, with
    ``alternatives`` (the reference's top tokens at each step, for bf16, whose rounding differs
    between kernels), ours among them passes (the rule vLLM's model tests use); else it diverged."""
    for i, (a, b) in enumerate(zip(ours, reference, strict=False)):
        if a != b:
            if margins[i] < near_tie:
                return Step(name, True, f"near-tie at token {i} (margin {margins[i]:.3f})")
            if alternatives is not None and a in alternatives[i]:
                rank = alternatives[i].index(a) + 1
                return Step(name, True, f"at token {i} ours is generate's #{rank} (margin {margins[i]:.3f})")
            return Step(name, False, f"diverged at token {i} (margin {margins[i]:.3f})")
    if len(ours) != len(reference):
        return Step(name, False, f"{len(ours)} tokens against {len(reference)}")
    return Step(name, True, f"{len(ours)} tokens equal")


def summary(steps: list[Step]) -> tuple[str, int]:
    """The closing table and the exit status (1 when a step failed; a step skipped for the budget
    is no failure)."""
    lines = ["", "| check | result | detail |", "| --- | --- | --- |"]
    lines += [f"| {s.name} | {result(s)} | {s.detail} |" for s in steps]
    return "\n".join(lines), 0 if all(s.ok for s in steps) else 1


def result(step: Step) -> str:
    return "skipped" if step.skipped else "ok" if step.ok else "FAILED"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gpu-dir", type=Path, default=REPO / ".gpu", help="what `make gpu-wheels` made")
    parser.add_argument("--skip-bench", action="store_true", help="the functional checks only")
    parser.add_argument(
        "--steps", default=",".join(STEPS), help=f"comma list, in order, of: {', '.join(STEPS)}"
    )
    parser.add_argument(
        "--part",
        choices=sorted(PARTS),
        help="half of the whole check (sets --steps, --families-cases and --compare-dtypes): "
        "make gpu-check PART=1, then PART=2",
    )
    parser.add_argument(
        "--families-cases", default="", help="gpu_families.py's --cases (default: all of them)"
    )
    parser.add_argument(
        "--compare-dtypes", default="float32,auto", help="the dtypes served and compared with generate"
    )
    parser.add_argument("--levels", default="1,16,64,256")
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens compared with generate")
    parser.add_argument("--device", default="cuda", help="cuda (the check) or cpu (a dry run of its steps)")
    parser.add_argument("--shape", default="1.7b", help="bench_gpu's model shape (tiny for a dry run)")
    parser.add_argument(
        "--summary", type=Path, help="also write the closing table to this file (updated after every step)"
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=560.0,
        help="seconds the whole check may take: steps are cut or skipped to fit, so the table is "
        "written before a device's 600 s command limit",
    )
    parser.add_argument("--bench-skip", default="serve", help="bench_gpu's --skip (serve, generate_batch)")
    parser.add_argument("--profile-rows", default="1,64,256", help="bench/profile_step.py's rows ('' = none)")
    parser.add_argument(
        "--interval-levels",
        default="",
        help="levels benched again with --stream-interval 4 (fewer messages per stream; measured twice "
        "on an H100 already, so none by default: the budget goes to what is not measured yet)",
    )
    parser.add_argument(
        "--unfused-levels",
        default="1",
        help="levels benched again with --no-fused-kernels (whether the fused kernels pay; '' = none)",
    )
    parser.add_argument(
        "--engine-levels",
        default="64,256",
        help="levels benched again with --engine-process (the engine in its own process; '' = none)",
    )
    parser.add_argument(
        "--server-levels",
        default="256",
        help="levels benched again with --api-server-count 2 over 8 connections ('' = none)",
    )
    parser.add_argument(
        "--serial-levels",
        default="1,64,256",
        help="levels benched again with --overlap-steps off (draws read between steps; '' = none)",
    )
    args = parser.parse_args(argv)
    if args.part:
        args.steps, args.families_cases, args.compare_dtypes = PARTS[args.part]
    return args


def run(name: str, command: list[str], env: dict[str, str], wanted: float, budget: Budget) -> Step:
    timeout = budget.timeout(wanted)
    if timeout is None:
        return skipped(name, budget)
    print(f"\n== {name}: {' '.join(command)}", flush=True)
    started = time.monotonic()
    # A session of its own: at the timeout the step's whole process group goes (the workers a step
    # started would otherwise hold the GPU's memory through the steps after it).
    proc = subprocess.Popen(command, cwd=REPO, env=env, start_new_session=True)
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        cut = " (all that was left of --budget)" if timeout < wanted else ""
        return Step(name, False, f"timed out after {timeout:.0f} s{cut}")
    return Step(name, code == 0, f"exit {code}, {time.monotonic() - started:.0f} s")


def guarded(name: str, work: Callable[[], list[Step]], budget: Budget) -> list[Step]:
    """``work``'s steps, or one failed step naming the exception (so the later steps still run);
    skipped when the budget has under MIN_STEP_S left."""
    if budget.timeout(MIN_STEP_S) is None:
        return [skipped(name, budget)]
    print(f"\n== {name}", flush=True)
    started = time.monotonic()
    try:
        steps = work()
    except Exception as error:
        import traceback

        traceback.print_exc()
        return [Step(name, False, repr(error)[:300])]
    print(f"== {name}: {time.monotonic() - started:.0f} s", flush=True)
    return steps


def prompt_ids(model_dir: Path) -> list[int]:
    """The first bench stream's chat prompt as token ids (both sides start from the same ids)."""
    from bench_gpu import prompt
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    chat = [{"role": "user", "content": prompt(0)}]
    return list(
        tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
    )


Reference = tuple[list[int], list[float], list[list[int]]]  # generate's tokens, margins and top 5s


def reference_greedy(
    model_dir: Path, ids: list[int], tokens: int, device: str, dtype: str, adapter: Path | None = None
) -> Reference:
    """transformers' ``generate`` from ``ids`` (with ``adapter``: peft's merged model of that LoRA
    adapter over ``model_dir``): its greedy tokens, the top-1 minus top-2 logit margins and the top 5
    tokens at each step."""
    import gc

    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload().eval()
    try:
        # An explicit mask: the prompt holds the pad token (<|im_end|>), which generate would mask.
        prompt = torch.tensor([ids], device=device)
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=tokens,
                             do_sample=False, eos_token_id=None, output_logits=True,
                             return_dict_in_generate=True)  # fmt: skip
        reference = out.sequences[0, len(ids) :].tolist()
        tops = [t[0].float().topk(5) for t in out.logits]
        margins = [float(top.values[0] - top.values[1]) for top in tops]
        return reference, margins, [top.indices.tolist() for top in tops]
    finally:
        del model
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()


def checked(name: str, got: list[int], reference: Reference, dtype: str) -> Step:
    """Greedy tokens against ``reference``: in float32 equal (bar exact near-ties); in 16 bits a
    first difference may be a near-tie or one of generate's top 5."""
    tokens, margins, tops = reference
    if dtype == "float32":
        return compare_greedy(got, tokens, margins, 1e-3, name=name)
    return compare_greedy(got, tokens, margins, NEAR_TIE, tops, name)


async def greedy_stream(
    stub: Any, ids: list[int], tokens: int, speculative: bool | None = None, model: str = ""
) -> tuple[list[int], float]:
    """``tokens`` greedy token ids after ``ids`` (``speculative``: the request's switch; ``model``: an
    adapter's name) and the seconds from the first to the last content event."""
    from sluice.v1 import worker_pb2 as pb

    sampling = pb.SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    if speculative is not None:
        sampling.speculative = speculative
    request = pb.GenerateRequest(
        model=model,
        prompt=pb.PromptInput(token_ids=pb.TokenIds(ids=ids)),
        sampling=sampling,
        return_token_ids=True,
    )
    got: list[int] = []
    first = last = 0.0
    async for event in stub.Generate(request):
        if event.WhichOneof("event") == "content":
            last = time.perf_counter()
            first = first or last
            got += list(event.content.token_ids)
    return got, last - first


def serving(
    model_dir: Path,
    device: str,
    dtype: str,
    extra: list[str],
    talk: Callable[[Any], Awaitable[T]],
    require_graphs: bool = True,
) -> tuple[T, str]:
    """Serves ``model_dir`` (``extra`` flags; on CUDA with --require-cuda-graphs unless
    ``require_graphs`` is False), runs ``talk`` with a stub of it; returns what it returned and the
    worker's /metrics text."""
    import grpc
    from bench_worker import free_port, start_worker, stop

    from sluice.v1 import worker_pb2_grpc as pb_grpc

    flags = ["--model", str(model_dir), "--device", device, "--dtype", dtype, "--max-running", "256",
             "--log-level", "INFO", *extra]  # fmt: skip
    if device.startswith("cuda") and require_graphs:
        flags.append("--require-cuda-graphs")
    metrics_port = free_port()
    proc, address = start_worker(None, flags, defaults=(), metrics_port=metrics_port)
    try:

        async def session() -> T:
            async with grpc.aio.insecure_channel(address) as channel:
                return await talk(pb_grpc.WorkerStub(channel))

        result = asyncio.run(session())
        url = f"http://127.0.0.1:{metrics_port}/metrics"
        text = urllib.request.urlopen(url, timeout=10).read().decode()
    finally:
        stop(proc)
    return result, text


def served_greedy(
    model_dir: Path, ids: list[int], tokens: int, device: str, dtype: str
) -> tuple[list[int], str]:
    """Greedy tokens from ``ids``, then 64 concurrent streams; the tokens and /metrics."""
    from bench_gpu import sluice_request
    from bench_worker import read_stream

    async def talk(stub: Any) -> list[int]:
        got, _ = await greedy_stream(stub, ids, tokens)
        await asyncio.gather(*[read_stream(stub, sluice_request(i, 64)) for i in range(64)])
        return got

    return serving(model_dir, device, dtype, [], talk)


def speculation_check(
    model_dir: Path,
    ids: list[int],
    tokens: int,
    device: str,
    dtype: str,
    compare: Callable[[list[int]], Step],
) -> list[Step]:
    """A worker with ``--speculative ngram``: greedy tokens with speculation equal ``compare``'s
    reference; one stream's decode tok/s over 128 tokens with the request's ``speculative`` off and
    on (alternating, twice) and the acceptance from /metrics, printed and in the step's detail."""

    async def talk(stub: Any) -> tuple[list[int], dict[bool, list[float]]]:
        got, _ = await greedy_stream(stub, ids, tokens)
        rates: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(2):
            for speculative in (False, True):
                out, seconds = await greedy_stream(stub, ids, 128, speculative)
                rates[speculative].append((len(out) - 1) / seconds if seconds else 0.0)
        return got, rates

    (got, rates), text = serving(model_dir, device, dtype, ["--speculative", "ngram"], talk)
    samples = parse_metrics(text)
    proposed = samples.get('sluice_worker_speculative_proposed_tokens_total{proposer="ngram"}', 0.0)
    accepted = samples.get('sluice_worker_speculative_accepted_tokens_total{proposer="ngram"}', 0.0)
    plain, fast = max(rates[False]), max(rates[True])
    speed = (f"1 stream {plain:.0f} -> {fast:.0f} tok/s ({fast / plain if plain else 0:.2f}x), "
             f"accepted {accepted:.0f}/{proposed:.0f}")  # fmt: skip
    print(f"speculation, {dtype}: {speed}", flush=True)
    equal = compare(got)
    return [Step(f"speculation vs generate, {dtype}", equal.ok, f"{equal.detail}; {speed}")]


def serve_and_compare(model_dir: Path, tokens: int, device: str, dtype: str) -> list[Step]:
    """Greedy served against ``generate`` and the fast path's metrics. In float32 the tokens must be
    equal (bar exact near-ties); in bf16 a first difference may be one of generate's top 5."""
    ids = prompt_ids(model_dir)
    got, text = served_greedy(model_dir, ids, tokens, device, dtype)
    samples = parse_metrics(text)
    shown = ("fast_path", "graph", "decode_only", "kv_cache_b")
    print("fast-path metrics:", {k: v for k, v in samples.items() if any(word in k for word in shown)})
    problems = fast_path_problems(samples)
    detail = "; ".join(problems) or "kernel, graphs, fused kernels, every decode-only step replayed"
    steps = [Step(f"fast path, {dtype} (metrics)", not problems, detail)]
    reference = reference_greedy(model_dir, ids, tokens, device, dtype)
    print(
        f"served   {got}\ngenerate {reference[0]}\nmargins  {[round(m, 3) for m in reference[1]]}", flush=True
    )

    def compare(tokens: list[int], name: str = f"greedy vs generate, {dtype}") -> Step:
        return checked(name, tokens, reference, dtype)

    steps.append(compare(got))
    steps += speculation_check(model_dir, ids, tokens, device, dtype, compare)
    return steps


def install_wheels(gpu_dir: Path) -> str | None:
    """Installs the carried wheels into :data:`SITE` (and the kernel packages' into
    :data:`KERNEL_SITE`); why not, or None."""
    wheels = sorted(str(p) for p in (gpu_dir / "wheels").glob("*.whl"))
    if not wheels:
        return f"no wheels in {gpu_dir / 'wheels'}: run `make gpu-wheels` where the network is"
    for site, folder in ((SITE, "wheels"), (KERNEL_SITE, "kernels")):
        found = sorted(str(p) for p in (gpu_dir / folder).glob("*.whl"))
        if found:
            pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--upgrade"]
            subprocess.run([*pip, "--no-compile", "--target", str(site), *found], check=True)
    return None


def hybrid_steps(args: argparse.Namespace, env: dict[str, str], budget: Budget) -> list[Step]:
    """bench_hybrid.py on the device (Sluice's runner against transformers' forward, a 24-layer
    Qwen3.5 shape) with transformers' torch forms, then with flash-linear-attention's kernels on the
    path; and the Qwen3.5 family served with those kernels (gpu_families.py)."""
    hybrid = [sys.executable, "bench/bench_hybrid.py", "--device", args.device, "--dtype", "bfloat16",
              "--hidden", "2048", "--layers", "24", "--prompt", "1024", "--decode", "32", "--batch", "1,32",
              "--rounds", "2"]  # fmt: skip
    kernels = {**env, "PYTHONPATH": f"{KERNEL_SITE}:{env['PYTHONPATH']}"}
    family = [sys.executable, "bench/gpu_families.py", "--cases", "qwen3_5_text", "--models",
              "/tmp/sluice-models/fla", "--device", args.device]  # fmt: skip
    return [
        run("bench_hybrid, torch forms", hybrid, env, 90, budget),
        run("bench_hybrid, flash-linear-attention", hybrid, kernels, 120, budget),
        run("qwen3_5_text served, flash-linear-attention", family, kernels, 120, budget),
    ]


def extra_benches(args: argparse.Namespace) -> list[tuple[str, str, float, list[str]]]:
    """The benches after the first, most telling first (worker flags, levels, timeout in s, bench
    flags): the engine in its own process, two serving processes (8 client connections, which the
    kernel spreads over them), each draw read between steps, the forward without the fused kernels,
    and (when asked) a stream's tokens of 4 steps per message."""
    wanted = [
        ("--engine-process", args.engine_levels, 150.0, []),
        ("--api-server-count 2", args.server_levels, 120.0, ["--connections", "8"]),
        ("--overlap-steps off", args.serial_levels, 150.0, []),
        ("--no-fused-kernels", args.unfused_levels, 120.0, []),
        ("--stream-interval 4", args.interval_levels, 150.0, []),
    ]
    return [entry for entry in wanted if entry[1]]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    budget = Budget(args.budget, started)
    problem = install_wheels(args.gpu_dir)
    if problem:
        print(problem, file=sys.stderr)
        return 1
    # Every process started from here (the tests, the workers, the bench) sees the carried wheels.
    os.environ.update(PYTHONPATH=f"{SITE}:{REPO}", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
    env = dict(os.environ)
    on_cuda = args.device.startswith("cuda")
    versions = "import sys,torch,triton,transformers,grpc,google.protobuf as p;print(sys.version.split()[0],"
    versions += (
        "'torch',torch.__version__,'triton',triton.__version__,'transformers',transformers.__version__,"
    )
    versions += "'grpcio',grpc.__version__,'protobuf',p.__version__,"
    versions += "torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA')"
    steps: list[Step] = []

    def add(*new: Step) -> None:  # the table so far, on file after every step
        steps.extend(new)
        if args.summary:
            args.summary.write_text(summary(steps)[0] + "\n")

    chosen = set(args.steps.split(","))
    if "versions" in chosen:
        add(run("versions", [sys.executable, "-c", versions], env, 60, budget))
    if "tests" in chosen:
        # The kernel's interpreted runs are the CPU suite's (Triton 3.6's interpreter fails on numpy 2.5).
        cuda_tests = [sys.executable, "-m", "pytest", "-q", "-s", "-rs", "-p", "no:cacheprovider",
                      "-k", "not interpreted", *CUDA_TESTS]  # fmt: skip
        test_env = {**env, "SLUICE_REQUIRE_CUDA": "1"} if on_cuda else env
        add(run("CUDA tests", cuda_tests, test_env, 180, budget))
    sys.path[:0] = [str(SITE), str(REPO), str(REPO / "bench")]
    from bench_gpu import build_model, resolved_dtype

    dtype = resolved_dtype(args.device, "auto")
    model_dir = Path(f"/tmp/sluice-models/{args.shape}-{dtype}")
    build_model(args.shape, model_dir, args.gpu_dir / "tok", args.device, dtype)
    kinds = [resolved_dtype(args.device, kind) for kind in args.compare_dtypes.split(",") if kind]
    for kind in dict.fromkeys(kinds) if "compare" in chosen else ():  # float32 first: the strict comparison
        folder = Path(f"/tmp/sluice-models/{args.shape}-{kind}")

        def compare(folder: Path = folder, kind: str = kind) -> list[Step]:
            build_model(args.shape, folder, args.gpu_dir / "tok", args.device, kind)
            return serve_and_compare(folder, args.tokens, args.device, kind)

        add(*guarded(f"serve and compare, {kind}", compare, budget))
    bench = [sys.executable, "bench/bench_gpu.py", "--model", str(model_dir),
             "--device", args.device, "--rounds", "2", "--max-running", "256"]  # fmt: skip
    if "bench" in chosen and not args.skip_bench:
        add(run("bench_gpu", [*bench, "--levels", args.levels, "--skip", args.bench_skip], env, 270, budget))
    if "families" in chosen:
        families = [sys.executable, "bench/gpu_families.py", "--dense", str(model_dir), "--device",
                    args.device, "--dtype", dtype, "--tokenizer", str(args.gpu_dir / "tok")]  # fmt: skip
        if args.families_cases:
            families += ["--cases", args.families_cases]
        add(run("families, KV dtypes, LoRA (gpu_families.py)", families, env, 300, budget))
    if "extra" in chosen and not args.skip_bench:
        for flags, levels, wanted, more in extra_benches(args):  # the same model, one setting changed
            again = [
                *bench,
                "--levels",
                levels,
                "--skip",
                "serve,generate_batch",
                f"--worker-args={flags}",
                *more,
            ]
            add(run(f"bench_gpu, {flags}", again, env, wanted, budget))
    if "edge" in chosen and not args.skip_bench:
        # The name bench_multiplexed's requests give (load_edge.MODEL), on the random model.
        worker = f"--model {model_dir} --device {args.device} --dtype {dtype} --torch-threads 4"
        worker += " --served-model-name SmolLM2-135M-Instruct"
        edge = [sys.executable, "bench/bench_multiplexed.py", f"--worker-args={worker}", "--concurrency",
                "64,256", "--rounds", "1", "--seconds", "5", "--latency-levels", ""]  # fmt: skip
        add(run("through the edge (bench_multiplexed.py)", edge, env, 180, budget))
    if "hybrid" in chosen:
        add(*hybrid_steps(args, env, budget))
    if "profile" in chosen and args.profile_rows:
        profile = [sys.executable, "bench/profile_step.py", "--model", str(model_dir),
                   "--device", args.device, "--rows", args.profile_rows, "--tokens", "64",
                   "--trace", "8"]  # fmt: skip
        add(run("profile_step", profile, env, 150, budget))
    table, status = summary(steps)
    table += f"\n\n{time.monotonic() - started:.0f} s in all"
    print(table, flush=True)
    if args.summary:
        args.summary.write_text(table + "\n")
    return status


if __name__ == "__main__":
    sys.exit(main())
