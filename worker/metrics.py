"""The worker's Prometheus metrics: one engine snapshot per scrape, on a small HTTP endpoint.

Design notes: docs/worker.md.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import socket
import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from sluice.prometheus import CONTENT_TYPE
from worker.engine.host_tier import TierStats
from worker.engine.stats import EngineStats

log = logging.getLogger(__name__)


class MetricNames(enum.StrEnum):
    """Which names the worker's metrics carry (``--metrics-names``)."""

    SLUICE = "sluice"  # sluice_worker_* only
    VLLM = "vllm"  # the endpoint picker's default (vLLM) names only
    BOTH = "both"

    @property
    def sluice(self) -> bool:
        return self in (MetricNames.SLUICE, MetricNames.BOTH)

    @property
    def vllm(self) -> bool:
        return self in (MetricNames.VLLM, MetricNames.BOTH)


# (name without the counter's "_total", help, EngineCounters attribute)
_COUNTERS = (
    ("sluice_worker_requests_submitted", "requests admitted", "requests_submitted"),
    ("sluice_worker_requests_finished", "requests finished", "requests_finished"),
    ("sluice_worker_requests_cancelled", "requests cancelled by callers", "requests_cancelled"),
    ("sluice_worker_requests_failed", "requests failed by the model", "requests_failed"),
    ("sluice_worker_generated_tokens", "completion tokens generated", "generated_tokens"),
    ("sluice_worker_prompt_tokens", "prompt tokens admitted", "prompt_tokens"),
    (
        "sluice_worker_prefix_cache_hit_tokens",
        "prompt tokens whose KV came from the prefix cache",
        "prefix_cache_hit_tokens",
    ),
    (
        "sluice_worker_preemptions",
        "requests sent back to the queue (recomputed later): KV blocks ran out, or the scheduling policy",
        "preemptions",
    ),
    ("sluice_worker_steps", "engine steps run", "steps"),
    (
        "sluice_worker_step_failures",
        "steps (or plans) whose failure failed the requests they touched; the engine went on",
        "step_failures",
    ),
    (
        "sluice_worker_decode_only_steps",
        "engine steps whose every row decoded one token (on CUDA each should replay a graph)",
        "decode_only_steps",
    ),
)
# With --speculative, labelled by proposer too (accepted / proposed: its acceptance rate).
_SPECULATIVE_COUNTERS = (
    (
        "sluice_worker_speculative_proposed_tokens",
        "speculative tokens proposed and verified (--speculative)",
        "speculative_proposed_tokens",
    ),
    (
        "sluice_worker_speculative_accepted_tokens",
        "speculative tokens accepted (the row's own draw equalled the proposal)",
        "speculative_accepted_tokens",
    ),
    (
        "sluice_worker_speculative_paused_rows",
        "times a row stopped proposing for a while, its acceptance below --speculative-min-acceptance",
        "speculative_paused_rows",
    ),
    (
        "sluice_worker_speculative_proposal_failures",
        "rows whose proposer raised: no proposals for that row in that step, nothing else failed",
        "speculative_proposal_failures",
    ),
)


class EngineCollector(Collector):
    """The metric families of one engine snapshot (``stats``), under the names ``names`` asks for.

    Built per scrape with that scrape's snapshot, so every series of one
    exposition describes the same instant.
    """

    def __init__(
        self,
        stats: EngineStats,
        model_id: str,
        names: MetricNames = MetricNames.SLUICE,
        *,
        fake_tokens: bool = False,
    ) -> None:
        self._stats = stats
        self._model_id = model_id
        self._names = names
        self._fake_tokens = fake_tokens

    def collect(self) -> Iterator[Metric]:
        if self._names.sluice:
            yield from self._sluice_families()
        if self._names.vllm:
            yield from self._vllm_families()
        if self._fake_tokens:
            yield self._gauge(
                "sluice_worker_fake_tokens",
                "1: this worker runs no model (--fake-tokens); its tokens are not generated",
                1,
            )

    def _gauge(self, name: str, help_text: str, value: float, label: str = "model") -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, help_text, labels=[label])
        family.add_metric([self._model_id], value)
        return family

    def _counter(self, name: str, help_text: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(name, help_text, labels=["model"])
        family.add_metric([self._model_id], value)
        return family

    def _sluice_families(self) -> Iterator[Metric]:
        s = self._stats
        yield self._gauge(
            "sluice_worker_queue_depth", "requests waiting for a batch slot", s.waiting_requests
        )
        yield self._gauge(
            "sluice_worker_running_requests", "requests in the running batch", s.running_requests
        )
        yield self._gauge(
            "sluice_worker_running_sequences", "sequences in the running batch", s.running_sequences
        )
        yield self._gauge("sluice_worker_live_caches", "sequences holding a KV cache", s.live_caches)
        yield self._gauge("sluice_worker_kv_cache_tokens", "tokens held in the KV cache", s.cache_tokens)
        yield self._gauge("sluice_worker_kv_cache_bytes", "bytes allocated for the KV cache", s.cache_bytes)
        yield self._gauge(
            "sluice_worker_state_cache_bytes",
            "bytes allocated for a hybrid model's recurrent states (0 without recurrent layers)",
            s.state_cache_bytes,
        )
        yield self._gauge(
            "sluice_worker_reserved_tokens",
            "prompt + max_tokens reserved by running sequences",
            s.reserved_tokens,
        )
        yield self._gauge(
            "sluice_worker_kv_cache_usage_ratio",
            "fraction of the KV cache's blocks in use, 0..1",
            s.kv_cache_usage,
        )
        yield self._gauge("sluice_worker_kv_cache_blocks", "blocks in the KV cache", s.kv_blocks_total)
        yield self._gauge(
            "sluice_worker_kv_cache_blocks_used",
            "KV cache blocks held by sequences (cached prefix blocks nobody holds are free)",
            s.kv_blocks_used,
        )
        info = GaugeMetricFamily(
            "sluice_worker_kv_cache_config_info",
            "1; the KV cache's shape in the labels: block_size (tokens per block), num_blocks",
            labels=["model", "block_size", "num_blocks"],
        )
        info.add_metric([self._model_id, str(s.kv_block_size), str(s.kv_blocks_total)], 1)
        yield info
        c = s.counters
        for name, help_text, attribute in _COUNTERS:
            yield self._counter(name, help_text, getattr(c, attribute))
        if s.speculative_proposer is not None:
            for name, help_text, attribute in _SPECULATIVE_COUNTERS:
                counter = CounterMetricFamily(name, help_text, labels=["model", "proposer"])
                counter.add_metric([self._model_id, s.speculative_proposer], getattr(c, attribute))
                yield counter
        ttft = c.time_to_first_token
        histogram = HistogramMetricFamily(
            "sluice_worker_time_to_first_token_seconds",
            "seconds from arrival to a choice's first token",
            labels=["model"],
        )
        histogram.add_metric([self._model_id], buckets=ttft.cumulative(), sum_value=ttft.total)
        yield histogram
        yield from self._class_families()
        if s.fast_path is not None or s.mixers_on_kernels is not None:
            yield from self._fast_path_families()
        if s.host_tier is not None:
            yield from self._host_tier_families(s.host_tier)

    def _host_tier_families(self, tier: TierStats) -> Iterator[Metric]:
        """``--kv-offload-bytes``'s host tier: its blocks, those in use, hits, bytes copied each way."""
        yield self._gauge("sluice_worker_kv_host_blocks", "blocks of the KV cache's host tier", tier.blocks)
        yield self._gauge(
            "sluice_worker_kv_host_blocks_used", "host-tier blocks holding an evicted prefix block", tier.used
        )
        for name, help_text, value in (
            (
                "sluice_worker_kv_host_hits",
                "prefix blocks copied back from the host tier for a hit",
                tier.hits,
            ),
            (
                "sluice_worker_kv_host_bytes_to_host",
                "bytes copied from the KV cache to its host tier",
                tier.bytes_to_host,
            ),
            (
                "sluice_worker_kv_host_bytes_to_device",
                "bytes copied from the host tier back to the KV cache",
                tier.bytes_to_device,
            ),
        ):
            yield self._counter(name, help_text, value)

    def _class_families(self) -> Iterator[Metric]:
        """The scheduling policy's metrics: queue wait and time to first token per (priority,
        tenant), preemptions by cause, refusals for deadlines (docs/observability.md)."""
        classes = self._stats.classes
        for name, help_text, family in (
            (
                "sluice_worker_queue_wait_seconds",
                "seconds from admission to a request's first start",
                classes.queue_wait,
            ),
            (
                "sluice_worker_class_time_to_first_token_seconds",
                "seconds from arrival to a choice's first token, by priority and tenant",
                classes.first_token,
            ),
        ):
            histogram = HistogramMetricFamily(name, help_text, labels=["model", "priority", "tenant"])
            for (priority, tenant), values in sorted(family.items()):
                histogram.add_metric(
                    [self._model_id, priority, tenant], buckets=values.cumulative(), sum_value=values.total
                )
            yield histogram
        causes = CounterMetricFamily(
            "sluice_worker_preemptions_by_cause",
            "requests sent back to the queue, by cause: blocks, priority, fairness",
            labels=["model", "cause"],
        )
        for cause in ("blocks", "priority", "fairness"):
            causes.add_metric([self._model_id, cause], classes.preemptions.get(cause, 0))
        yield causes
        yield self._counter(
            "sluice_worker_deadline_refusals",
            "requests refused at admission because they could not finish before their deadline",
            classes.deadline_refusals,
        )

    def _fast_path_families(self) -> Iterator[Metric]:
        """Which parts of the fast path are on: the CUDA decode path's and the graph replays (CUDA
        only), a hybrid model's mixer kernels (any device)."""
        s = self._stats
        fast = GaugeMetricFamily(
            "sluice_worker_fast_path",
            "1 when this part of the fast path is on (kernel: the Triton decode attention; graphs: decode "
            "steps replayed from CUDA graphs; fused: the fused RMSNorm, SiLU-mul and rotary kernels; quant: "
            "every int4 and fp8 layer on its CUDA kernel, for a quantized model; these on CUDA only; "
            "mixers: a hybrid model's recurrent mixers on the flash-linear-attention, "
            "causal-conv1d and mamba-ssm kernels); 0: a slower fallback serves (mixers: transformers' torch "
            "forms)",
            labels=["model", "part"],
        )
        if s.fast_path is not None:
            fast.add_metric([self._model_id, "kernel"], int(s.fast_path.kernel))
            fast.add_metric([self._model_id, "graphs"], int(s.fast_path.graphs))
            fast.add_metric([self._model_id, "fused"], int(s.fast_path.fused))
            if s.fast_path.quant is not None:
                fast.add_metric([self._model_id, "quant"], int(s.fast_path.quant))
        if s.mixers_on_kernels is not None:
            fast.add_metric([self._model_id, "mixers"], int(s.mixers_on_kernels))
        yield fast
        if s.fast_path is None:
            return
        yield self._counter(
            "sluice_worker_decode_graph_replays", "decode steps replayed from a CUDA graph", s.graph_replays
        )
        if s.max_loras:
            yield self._counter(
                "sluice_worker_decode_graph_lora_replays",
                "decode steps with LoRA adapter rows replayed from a CUDA graph",
                s.graph_lora_replays,
            )

    def _vllm_families(self) -> Iterator[Metric]:
        s = self._stats
        yield self._gauge(
            "vllm:num_requests_waiting", "Requests waiting to be processed.", s.waiting_requests, "model_name"
        )
        yield self._gauge(
            "vllm:num_requests_running", "Requests in the running batch.", s.running_requests, "model_name"
        )
        yield self._gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            s.kv_cache_usage,
            "model_name",
        )
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the KV cache config (value 1; block_size, num_gpu_blocks in the labels).",
            labels=["block_size", "num_gpu_blocks"],
        )
        info.add_metric([str(s.kv_block_size), str(s.kv_blocks_total)], 1)
        yield info
        if s.max_loras:
            loras = GaugeMetricFamily(
                "vllm:lora_requests_info",
                "Running and waiting LoRA adapters (value: the scrape's Unix time, as vLLM's).",
                labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
            )
            running, waiting = ",".join(s.running_loras), ",".join(s.waiting_loras)
            loras.add_metric([str(s.max_loras), running, waiting], time.time())
            yield loras


def render(
    stats: EngineStats, model_id: str, names: MetricNames = MetricNames.SLUICE, *, fake_tokens: bool = False
) -> str:
    """The exposition text (format 0.0.4) for one engine snapshot; ``fake_tokens`` adds
    ``sluice_worker_fake_tokens 1`` (a worker started with ``--fake-tokens``, whatever the names)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(stats, model_id, names, fake_tokens=fake_tokens))
    return generate_latest(registry).decode()


async def serve_metrics(sock: socket.socket, text: Callable[[], str | None]) -> asyncio.Server:
    """Serves ``GET /metrics`` on the listening ``sock``; ``text()`` None (no model yet) is a 503, and
    a ``text()`` that raises a 500 (a scrape always gets an answer). ``text`` runs on the event loop:
    it must not wait (the engine's published stats, never its lock)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request_line = await asyncio.wait_for(reader.readline(), 5)
            while (await asyncio.wait_for(reader.readline(), 5)) not in (b"\r\n", b"\n", b""):
                pass
            status, body, ctype = _answer(request_line, text)
            writer.write(
                f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                "Connection: close\r\n\r\n".encode()
                + body
            )
            await writer.drain()
        except (TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()

    return await asyncio.start_server(handle, sock=sock)


def _answer(request_line: bytes, text: Callable[[], str | None]) -> tuple[str, bytes, str]:
    """(status, body, content type) for one request line."""
    parts = request_line.decode("latin-1").split()
    if len(parts) < 2 or parts[0] != "GET" or parts[1].split("?")[0] != "/metrics":
        return "404 Not Found", b"not found\n", "text/plain"
    try:
        exposition = text()
    except Exception as error:
        log.exception("rendering the metrics failed")
        return "500 Internal Server Error", f"{type(error).__name__}\n".encode(), "text/plain"
    if exposition is None:
        return "503 Service Unavailable", b"the model is loading\n", "text/plain"
    return "200 OK", exposition.encode(), CONTENT_TYPE
