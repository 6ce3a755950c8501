"""The GPU benchmark's pure helpers: its level parsing and the table it prints (no model, no timing)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from bench_gpu import (
    SHAPES,
    Table,
    format_table,
    parse_levels,
    parse_skip,
    resolved_dtype,
    sluice_worker_flags,
)
from bench_worker import WORKER_DEFAULTS, merged_flags


def test_levels_parse_and_refuse_bad_values() -> None:
    assert parse_levels("1,16,64,256") == [1, 16, 64, 256]
    for bad in ("", "0,4", "1,x"):
        with pytest.raises(argparse.ArgumentTypeError, match="--levels"):
            parse_levels(bad)


def test_skip_names_only_known_servers() -> None:
    assert parse_skip("serve, generate_batch") == {"serve", "generate_batch"}
    with pytest.raises(argparse.ArgumentTypeError, match="vllm"):
        parse_skip("vllm")


def test_dtype_follows_the_workers_auto_rule() -> None:
    assert resolved_dtype("cuda", "auto") == "bfloat16"
    assert resolved_dtype("cuda:1", "auto") == "bfloat16"
    assert resolved_dtype("cpu", "auto") == "float32"
    assert resolved_dtype("cuda", "float16") == "float16"


def test_table_has_one_row_per_level_with_ratios_and_gaps() -> None:
    table = Table(
        "SmolLM2-1.7B",
        first={1: 100.0, 64: 4000.0},
        sluice={1: 200.0, 64: 8000.0},
        generate_batch={64: 2000.0},
        notes=["transformers serve skipped: needs transformers[serving]"],
    )
    lines = format_table(table, [1, 64]).splitlines()
    assert lines[0].startswith("| model shape | streams | Sluice tok/s | Sluice first round")
    assert lines[2] == "| SmolLM2-1.7B | 1 | 200.0 (5.0 ms/token) | 100.0 (0.50x) | - | - | - |"
    assert lines[3] == "| SmolLM2-1.7B | 64 | 8,000.0 | 4,000.0 (0.50x) | 2,000.0 | - | 4.00x |"
    assert lines[-1] == "transformers serve skipped: needs transformers[serving]"


def test_named_shapes_are_the_issue_models() -> None:
    assert SHAPES["1.7b"]["hidden_size"] == 2048 and SHAPES["1.7b"]["num_hidden_layers"] == 24
    assert SHAPES["8b"]["num_key_value_heads"] == 8 and SHAPES["8b"]["tie_word_embeddings"] is False


def test_the_worker_gets_room_for_the_largest_level_and_info_logs() -> None:
    flags = sluice_worker_flags(Path("/m"), "cuda", "bfloat16", [1, 16, 256], "")
    assert flags[flags.index("--max-running") + 1] == "256" and flags.count("--max-running") == 1
    assert flags[flags.index("--log-level") + 1] == "INFO"
    chosen = sluice_worker_flags(Path("/m"), "cuda", "bfloat16", [1, 256], "--max-running 512", 300)
    assert chosen.count("--max-running") == 1 and chosen[chosen.index("--max-running") + 1] == "512"


def test_extra_worker_flags_win_over_the_benchmarks_defaults() -> None:
    merged = merged_flags(WORKER_DEFAULTS, ["--max-running", "256", "--log-level=INFO", "--fake-tokens"])
    assert merged == ["--max-running", "256", "--log-level=INFO", "--fake-tokens"]
    assert merged_flags(WORKER_DEFAULTS, ["--dtype", "float32"])[:4] == list(WORKER_DEFAULTS)


def test_a_given_tokenizer_needs_no_default_model_package(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import bench_gpu

    def refuse(*_: object) -> Path:
        raise AssertionError("the default model package was asked for")

    monkeypatch.setattr(bench_gpu, "default_tokenizer_dir", refuse)
    assert bench_gpu.tokenizer_dir(Path("/tok")) == Path("/tok")
