"""The GPU check's CPU-side parts: arguments, the metrics it reads, the greedy verdict, the summary,
and the wheel list (no GPU, no network)."""

from __future__ import annotations

import importlib.metadata
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from gpu_check import (
    MIN_STEP_S,
    RESERVE_S,
    STEPS,
    Budget,
    Step,
    compare_greedy,
    extra_benches,
    fast_path_problems,
    parse_args,
    parse_metrics,
    run,
    summary,
)
from gpu_families import CASES
from gpu_wheels import MISSING, NEWER, download_command, pins

METRICS = """# HELP sluice_worker_fast_path 1 when on
sluice_worker_fast_path{model="m",part="kernel"} 1.0
sluice_worker_fast_path{model="m",part="graphs"} 1.0
sluice_worker_fast_path{model="m",part="fused"} 1.0
sluice_worker_decode_only_steps_total{model="m"} 40.0
sluice_worker_decode_graph_replays_total{model="m"} 40.0
"""


def test_metrics_are_read_and_a_healthy_fast_path_passes() -> None:
    samples = parse_metrics(METRICS)
    assert samples['sluice_worker_fast_path{part="kernel"}'] == 1.0
    assert fast_path_problems(samples) == []


def test_an_off_part_or_a_step_without_a_replay_fails() -> None:
    text = METRICS.replace('part="graphs"} 1.0', 'part="graphs"} 0.0').replace(
        'replays_total{model="m"} 40', 'replays_total{model="m"} 39'
    )
    assert fast_path_problems(parse_metrics(text)) == [
        "graphs is off",
        "39 graph replays for 40 decode-only steps",
    ]
    assert fast_path_problems({}) == [
        "kernel is off",
        "graphs is off",
        "fused is off",
        "no decode-only step ran",
    ]


def test_a_divergence_at_a_near_tie_is_not_a_failure() -> None:
    assert compare_greedy([1, 2, 3], [1, 2, 3], [1.0, 1.0, 1.0]).ok
    tie = compare_greedy([1, 2, 9], [1, 2, 3], [1.0, 1.0, 0.01])
    assert tie.ok and "near-tie at token 2" in tie.detail
    real = compare_greedy([1, 9, 3], [1, 2, 3], [1.0, 2.5, 1.0])
    assert not real.ok and "diverged at token 1" in real.detail
    assert not compare_greedy([1, 2], [1, 2, 3], [1.0] * 3).ok


def test_in_bf16_a_first_difference_among_generates_top_tokens_passes() -> None:
    tops = [[1, 5], [2, 7, 9], [3, 4]]
    among = compare_greedy([1, 9, 3], [1, 2, 3], [1.0, 2.5, 1.0], alternatives=tops)
    assert among.ok and "ours is generate's #3" in among.detail
    assert not compare_greedy([1, 8, 3], [1, 2, 3], [1.0, 2.5, 1.0], alternatives=tops).ok
    strict = compare_greedy([1, 9, 3], [1, 2, 3], [1.0, 2.5, 1.0], near_tie=1e-3, name="float32")
    assert not strict.ok and strict.name == "float32"


def test_the_summary_fails_when_any_step_failed() -> None:
    table, status = summary([Step("versions", True), Step("CUDA tests", False, "exit 1")])
    assert status == 1 and "| CUDA tests | FAILED | exit 1 |" in table
    assert summary([Step("versions", True)])[1] == 0


def test_a_step_skipped_for_the_budget_is_shown_and_fails_nothing() -> None:
    table, status = summary([Step("versions", True), Step("profile_step", True, "skipped: ...", True)])
    assert status == 0 and "| profile_step | skipped | skipped: ... |" in table


def test_the_budget_cuts_a_steps_timeout_then_skips_it() -> None:
    budget = Budget(seconds=100.0, started=0.0)
    assert budget.timeout(20.0, now=0.0) == 20.0
    assert budget.timeout(150.0, now=50.0) == 100.0 - 50.0 - RESERVE_S  # cut to what is left
    assert budget.timeout(150.0, now=100.0 - RESERVE_S - MIN_STEP_S + 1) is None
    spent = Budget(seconds=1.0, started=0.0)
    step = run("bench_gpu", ["/no/such/command"], {}, 60.0, spent)  # never started
    assert step.skipped and step.ok and "--budget 1" in step.detail


def test_the_benches_after_the_first_run_most_telling_first() -> None:
    benches = extra_benches(parse_args([]))
    assert [flags for flags, _, _, _ in benches] == [
        "--engine-process",
        "--api-server-count 2",
        "--overlap-steps off",
        "--no-fused-kernels",
    ]
    assert benches[1][3] == ["--connections", "8"]  # spread over both serving processes
    asked = extra_benches(
        parse_args(["--interval-levels", "256", "--unfused-levels", "", "--server-levels", ""])
    )
    assert [(flags, levels) for flags, levels, _, _ in asked] == [
        ("--engine-process", "64,256"),
        ("--overlap-steps off", "1,64,256"),
        ("--stream-interval 4", "256"),
    ]


def test_arguments() -> None:
    args = parse_args(["--skip-bench", "--tokens", "16"])
    assert args.skip_bench and args.tokens == 16 and args.levels == "1,16,64,256"
    assert args.device == "cuda" and args.shape == "1.7b" and args.bench_skip == "serve"
    assert (args.interval_levels, args.unfused_levels, args.engine_levels) == ("", "1", "64,256")
    assert args.serial_levels == "1,64,256" and args.budget == 560.0
    first, second = parse_args(["--part", "1"]), parse_args(["--part", "2"])
    assert "bench" in first.steps.split(",") and "lora" in first.families_cases.split(",")
    assert "extra" in second.steps.split(",") and "kv-fp8" in second.families_cases.split(",")
    halves = set(first.steps.split(",")) | set(second.steps.split(","))
    assert halves == set(STEPS)  # the two parts run every step between them
    cases = set(first.families_cases.split(",")) | set(second.families_cases.split(","))
    assert cases == set(CASES)
    dry = parse_args(["--device", "cpu", "--shape", "tiny", "--profile-rows", "", "--interval-levels", ""])
    assert dry.device == "cpu" and dry.shape == "tiny" and not dry.profile_rows and not dry.interval_levels


def test_the_wheels_are_exactly_what_the_device_lacks_for_python_3_12(tmp_path: Path) -> None:
    for name in ("gguf", "llguidance", "quart", "hypercorn", "pydantic", "orjson", "grpcio-health-checking",
                 "grpcio-reflection", "grpcio-status", "googleapis-common-protos", "pillow"):  # fmt: skip
        assert name in MISSING
    assert {"grpcio", "protobuf", "transformers"} <= set(NEWER)
    assert not {"torch", "triton"} & set(MISSING + NEWER)

    def version(name: str) -> str:
        if name != "gguf":
            raise importlib.metadata.PackageNotFoundError(name)
        return "1.0"

    assert pins(("gguf", "nope"), version=version) == ["gguf==1.0", "nope"]
    command = download_command(["gguf==1.0"], tmp_path)
    assert command[command.index("--python-version") + 1] == "3.12" and "--no-deps" in command


def test_a_step_cut_by_its_timeout_takes_the_processes_it_started_with_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import gpu_check

    monkeypatch.setattr(gpu_check, "MIN_STEP_S", 0.0)
    monkeypatch.setattr(gpu_check, "RESERVE_S", 0.0)
    pid_file = tmp_path / "child.pid"
    # A step that starts a child of its own (as a bench starts a worker), then outlives its timeout.
    script = (
        "import subprocess, sys, time; "
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        f"open({str(pid_file)!r}, 'w').write(str(child.pid)); time.sleep(60)"
    )
    step = run(
        "sleeper", [sys.executable, "-c", script], {}, 60.0, Budget(seconds=2.0, started=time.monotonic())
    )
    assert not step.ok and "timed out" in step.detail
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child}").exists() and "Z" not in Path(f"/proc/{child}/stat").read_text().split()[2]:
        assert time.monotonic() < deadline, "the step's child outlived the step"
        time.sleep(0.05)
